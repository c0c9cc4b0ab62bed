"""Tests of the FSDP2 training engine, its sharded checkpoints and the bucketed weight sync.

One 2-rank gloo group (``_fsdp_worker.py``) runs every distributed scenario once per module; each test checks
one thing it recorded against a reference computed here: the single-process :class:`TorchTrainEngine` on the
same batches, hand-computed gradient reductions, or the weights themselves.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from relax_services.config import ModelConfig
from relax_services.control.checkpoint import ENGINE_FILE
from relax_services.engines import TorchTrainEngine, TorchValueEngine
from relax_services.engines.fsdp.checkpoint import checkpoint_model_state
from relax_services.engines.fsdp.train import FSDPConfig, FSDPTrainEngine, decoder_blocks
from relax_services.models import build_tiny_omni, build_value_model, load_model
from relax_services.models.export import export_checkpoint
from relax_services.models.lora import ADAPTER_FOLDER, adapter_state
from relax_services.weights.buckets import (
    BucketLoader,
    InProcessWeightStream,
    WeightStream,
    bucket_tensors,
    pack_bucket,
    stream_buckets,
    unpack_bucket,
)

WORLD = 2
# The 2-rank gradient is the single-process one up to the order in which float partial sums are added (each
# rank sums its micro-batches, then the ranks' sums are added; the grad norm adds per-shard squares), ~1e-7
# relative; six AdamW steps at lr 1e-2 turn that into ~5e-6 absolute on the weights (observed 4.7e-6).
ATOL = 5e-5

# AdamW divides each update by the root of its second moment (plus eps = 1e-8), so a weight whose gradient is near
# zero moves by up to ~lr per step whatever the gradient's size: float32 summation-order noise (~1e-7 relative,
# ~1e-8 absolute on the tiny model's gradients, comparable to eps) can then move that weight by a sizeable share of
# lr (6.3e-5 seen on one CPU after four steps at lr 1e-2), a figure no bound on the sums controls. In float64 the
# same noise is ~2^-53 relative (1e-17 absolute), a billion times below eps, so AdamW passes it on unamplified:
# four steps at lr 1e-2 give at most lr * 4 * 1e-17 / 1e-8 = 4e-11. A wrong combination of micro-batches moves
# weights by 1e-3 and more (the reference update itself).
ATOL_F64 = 1e-9

# The two ranks' run takes ~2 min alone and up to ~5 min on a loaded machine; the default 300 s is too tight.
pytestmark = pytest.mark.timeout(900)


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_fsdp_worker", Path(__file__).with_name("_fsdp_worker.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the two ranks recorded."""
    out = tmp_path_factory.mktemp("fsdp")
    script = Path(__file__).with_name("_fsdp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(WORLD), str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(WORLD)
    ]
    try:
        errors = [p.communicate(timeout=600)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errors)
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    results[0]["folder"] = out
    return results


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The single-process engine on the worker's batches and config."""
    torch.manual_seed(0)
    engine = TorchTrainEngine(build_tiny_omni(0), worker.CONFIG)
    initial = engine.policy_state()
    metrics = [engine.step(worker.batch(s), worker.pg_token_mean) for s in range(worker.UPDATES)]
    logprobs = engine.compute_logprobs(worker.batch(100))
    return {"initial": initial, "metrics": metrics, "weights": engine.policy_state(), "logprobs": logprobs}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)  # exact for float32 too


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_train_with_the_full_kl_as_one_process_does(ranks: list[dict[str, Any]]) -> None:
    """Each rank holds a whole copy of the frozen reference (never sharded) and sums the exact KL over its share;
    the update equals the single-process engine's with the same reference, in float64 (``ATOL_F64``)."""
    torch.manual_seed(0)
    config = worker.FULL_KL_CONFIG
    engine = TorchTrainEngine(build_tiny_omni(0).double(), config, reference=build_tiny_omni(1).double())
    initial = engine.policy_state()
    metrics = [engine.step(worker.batch(s), worker.pg_with_full_kl) for s in range(worker.FULL_KL_UPDATES)]
    assert all(m["kl"] > 1e-3 for m in metrics)  # a KL term of weight
    assert _max_diff(engine.policy_state(), initial) > 1e-3
    for r in ranks:
        assert not r["full_kl_reference_sharded"]
        assert _max_diff(r["full_kl_weights"], engine.policy_state()) < ATOL_F64
        for got, want in zip(r["full_kl_metrics"], metrics, strict=True):
            assert got["kl"] == pytest.approx(want["kl"], rel=1e-9)


# -- gradient reduction on gloo ---------------------------------------------------------------------------------


def test_gloo_gradient_reduction_is_the_exact_average_and_the_exact_sum(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["gloo_average_diff"] == 0.0  # default reduction: (g0 + g1) / 2, computed by hand
        assert r["gloo_sum_diff"] == 0.0  # divide factor 1 (the engine's setting): g0 + g1


# -- 2 ranks equal one process ----------------------------------------------------------------------------------


def test_two_ranks_train_the_weights_one_process_trains(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    moved = _max_diff(reference["weights"], reference["initial"])
    assert moved > 200 * ATOL  # the updates are large against the tolerance
    assert _max_diff(ranks[0]["weights"], reference["weights"]) < ATOL
    assert _equal(ranks[0]["weights"], ranks[1]["weights"])  # every rank gathers the same full weights
    # A weight no sample used (the audio tower's bos/eos embedding) is untouched, as in one process.
    name = "audio_tower.audio_bos_eos_token.weight"
    assert torch.equal(ranks[0]["weights"][name], reference["initial"][name])


def test_a_rank_built_on_the_meta_device_receives_rank_0s_weights(
    ranks: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    # Only rank 0 read the checkpoint; rank 1's shards and buffers came from it, so both start from the checkpoint's
    # exact weights and train bit for bit as the group whose ranks both loaded it.
    assert [r["built_empty"] for r in ranks] == [False, True]
    assert _equal(ranks[0]["initial_from_rank0"], reference["initial"])
    assert _equal(ranks[0]["weights_from_rank0"], ranks[0]["weights"])


def test_micro_batches_combine_by_the_units_the_loss_reports(ranks: list[dict[str, Any]]) -> None:
    # References: one process with the worker's micro-batches of 1, and with each minibatch as ONE micro-batch
    # (nothing to combine). Every micro-batch keeps a different number of tokens, some none.
    weights, metrics = [], []
    for micro in (1, 4):
        torch.manual_seed(0)
        model = build_tiny_omni(0).double()  # as the worker's group: float64 (ATOL_F64)
        engine = TorchTrainEngine(model, dataclasses.replace(worker.CONFIG, micro_batch_size=micro))
        metrics.append([engine.step(worker.batch(s), worker.pg_kept_mean) for s in range(2)])
        weights.append(engine.policy_state())
    initial = build_tiny_omni(0).double().state_dict()
    assert _max_diff({k: initial[k] for k in weights[1]}, weights[1]) > 1e-3  # the updates moved the weights
    assert _max_diff(weights[0], weights[1]) < ATOL_F64
    assert _max_diff(ranks[0]["units_weights"], weights[1]) < ATOL_F64
    for ours, same_micro, whole in zip(ranks[0]["units_metrics"], metrics[0], metrics[1], strict=True):
        assert ours["loss"] == pytest.approx(whole["loss"], rel=1e-4)  # the step's loss, however it was split
        # The loss's own metrics are unit-weighted means over micro-batches: equal for the same micro-batches.
        assert ours["kept"] == pytest.approx(same_micro["kept"], rel=1e-5)


def test_env_tokens_weigh_nothing_on_two_ranks(ranks: list[dict[str, Any]]) -> None:
    """A plain token-mean loss over samples with environment tokens: the ranks' micro-batches of one, weighted by
    their policy tokens, train as one process with each minibatch as ONE micro-batch (no weights at all); float64
    (``ATOL_F64``). Weights that counted environment tokens move the result by the update's own size."""
    torch.manual_seed(0)
    engine = TorchTrainEngine(build_tiny_omni(0).double(), dataclasses.replace(worker.CONFIG, micro_batch_size=4))
    metrics = [engine.step(worker.masked_batch(s), worker.pg_token_mean) for s in range(2)]
    assert _max_diff(ranks[0]["masked_weights"], engine.policy_state()) < ATOL_F64
    assert _equal(ranks[0]["masked_weights"], ranks[1]["masked_weights"])
    policy_tokens = sum(int(s.fields[worker.LOSS_MASK_FIELD].sum()) for s in worker.masked_batch(1))
    assert policy_tokens < sum(len(s.response_ids) for s in worker.masked_batch(1))
    assert (
        ranks[0]["masked_metrics"][-1]["tokens"] == metrics[-1]["tokens"] == policy_tokens / worker.CONFIG.minibatches
    )
    assert ranks[0]["masked_metrics"][-1]["loss"] == pytest.approx(metrics[-1]["loss"], abs=ATOL_F64)


def test_token_budget_micro_batches_of_packed_responses_train_as_one_padded_micro_batch(
    ranks: list[dict[str, Any]],
) -> None:
    # Reference: one process, each minibatch ONE padded micro-batch, float64 as the worker's group (ATOL_F64).
    torch.manual_seed(0)
    engine = TorchTrainEngine(build_tiny_omni(0).double(), dataclasses.replace(worker.CONFIG, micro_batch_size=4))
    metrics = [engine.step(worker.batch(s), worker.pg_kept_mean) for s in range(2)]
    assert [r["budget_micro_batches"] for r in ranks] == [[2], [2]]  # rank 0 cut its one micro-batch in two
    assert _max_diff(ranks[0]["budget_weights"], engine.policy_state()) < ATOL_F64
    assert _equal(ranks[0]["budget_weights"], ranks[1]["budget_weights"])
    assert all(m["padding_frac"] == 0.0 for r in ranks for m in r["budget_metrics"])
    assert all(m["padding_frac"] > 0.0 for m in metrics)
    assert ranks[0]["budget_metrics"][-1]["loss"] == pytest.approx(metrics[-1]["loss"], abs=ATOL_F64)


def test_a_state_dict_before_the_first_update_changes_nothing(ranks: list[dict[str, Any]]) -> None:
    # get_state_dict creates a fresh optimizer's moments with an lr-0 step, which made AdamW count the first
    # real update as its second (other bias correction: the weights moved differently, ~lr/4 after one update).
    for r in ranks:
        assert r["step0_moments"] == 0 and r["step0_resumed_moments"] == 0
    assert _equal(ranks[0]["step0_weights"], ranks[0]["weights"])  # as the engine that never took a state dict
    assert _equal(ranks[0]["step0_resumed_weights"], ranks[0]["weights"])


def test_two_ranks_report_the_single_process_metrics(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for ours, theirs in zip(ranks[0]["metrics"], reference["metrics"], strict=True):
        assert ours.keys() == theirs.keys()
        for key in ("loss", "entropy", "tokens", "mean_reward", "grad_norm", "lr", "version"):
            assert ours[key] == pytest.approx(theirs[key], rel=1e-5, abs=1e-6), key
        assert ours["grad_norm"] > worker.CONFIG.grad_clip  # clipping was active
    for a, b in zip(ranks[0]["metrics"], ranks[1]["metrics"], strict=True):
        assert {k: v for k, v in a.items() if k != "step_s"} == {k: v for k, v in b.items() if k != "step_s"}


def test_logprobs_of_the_whole_batch_are_gathered_from_the_shares(
    ranks: list[dict[str, Any]], reference: dict[str, Any]
) -> None:
    logprobs, mask = ranks[0]["logprobs"]
    ref_logprobs, ref_mask = reference["logprobs"]
    assert torch.equal(mask, ref_mask)
    assert torch.allclose(logprobs, ref_logprobs, atol=1e-4)


def test_activation_checkpointing_gives_the_same_updates(ranks: list[dict[str, Any]]) -> None:
    assert _equal(ranks[0]["weights_checkpointed"], ranks[0]["weights"])


def test_a_batch_that_does_not_split_over_the_ranks_is_refused(ranks: list[dict[str, Any]]) -> None:
    assert "multiple of the world size" in ranks[0]["uneven_error"]
    assert ranks[0]["is_train_engine"]


def test_two_ranks_train_the_critic_one_process_trains(ranks: list[dict[str, Any]]) -> None:
    engine = TorchValueEngine(build_value_model(build_tiny_omni(0)), worker.CONFIG)
    initial = engine.policy_state()
    metrics = [engine.step(worker.batch(s), worker.value_mse) for s in range(2)]
    weights = engine.policy_state()
    assert _max_diff(weights, initial) > 200 * ATOL
    # Looser than the policy's ATOL: the value head starts at zero, so the backbone's first gradients are tiny
    # and Adam's division by their running RMS magnifies the ranks' different summation order (8.5e-5 seen).
    assert _max_diff(ranks[0]["critic_weights"], weights) < 4 * ATOL
    for ours, theirs in zip(ranks[0]["critic_metrics"], metrics, strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
    values, mask = ranks[0]["critic_values"]
    ref_values, ref_mask = engine.compute_values(worker.batch(100))
    assert torch.equal(mask, ref_mask)
    assert torch.allclose(values, ref_values, atol=1e-4)


# -- LoRA -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lora_reference() -> dict[str, Any]:
    """The single-process engine with the worker's adapters, in float64 as the worker's LoRA group."""
    torch.manual_seed(0)
    engine = TorchTrainEngine(build_tiny_omni(0).double(), worker.LORA_CONFIG)
    initial = adapter_state(engine.model)
    metrics = [engine.step(worker.batch(s), worker.pg_token_mean) for s in range(worker.LORA_UPDATES)]
    return {
        "initial": initial,
        "metrics": metrics,
        "adapters": adapter_state(engine.model),
        "weights": engine.policy_state(),
    }


def test_two_ranks_train_lora_adapters_as_one_process_does(
    ranks: list[dict[str, Any]], lora_reference: dict[str, Any]
) -> None:
    """Same initial adapters on every rank (rank 1, built on the meta device, receives rank 0's), the same losses,
    adapters and merged published weights as one process, to float64 summation order (``ATOL_F64``)."""
    initial = lora_reference["initial"]
    assert all(not torch.any(v) for k, v in initial.items() if ".lora_B." in k)  # B starts at zero
    for r in ranks:
        assert _equal(r["lora_initial_adapters"], initial)
        # Merged with B = 0: the checkpoint's own weights, under the plain model's names.
        assert _equal(r["lora_initial"], build_tiny_omni(0).double().state_dict())
    for ours, theirs in zip(ranks[0]["lora_metrics"], lora_reference["metrics"], strict=True):
        assert ours["loss"] == pytest.approx(theirs["loss"], abs=ATOL_F64)
    adapters = {k: ranks[0]["lora_raw"][k] for k in initial}
    assert _max_diff(lora_reference["adapters"], initial) > 1e-2  # the updates moved the adapters
    assert _max_diff(adapters, lora_reference["adapters"]) < ATOL_F64
    assert _max_diff(ranks[0]["lora_weights"], lora_reference["weights"]) < ATOL_F64  # same names, merged
    assert _max_diff(lora_reference["weights"], ranks[0]["lora_initial"]) > 1e-3
    assert _equal(ranks[0]["lora_weights"], ranks[1]["lora_weights"])
    assert _equal(ranks[0]["lora_checkpointed_weights"], ranks[0]["lora_weights"])  # activation checkpointing


def test_lora_on_two_ranks_trains_and_keeps_state_for_the_adapters_only(
    ranks: list[dict[str, Any]], lora_reference: dict[str, Any]
) -> None:
    r = ranks[0]
    adapters = sorted(lora_reference["initial"])
    assert r["lora_trainable"] == r["lora_optimized"] == adapters  # the optimizer holds the adapters alone
    assert r["lora_moments"] and set(r["lora_moments"]) <= set(adapters)
    # The frozen weights keep their bits: every unmerged tensor but the adapters is the checkpoint's.
    base = build_tiny_omni(0).double().state_dict()
    frozen = {k: v for k, v in r["lora_raw"].items() if k not in lora_reference["initial"]}
    assert _equal({k: base[k.replace(".base_layer.", ".")] for k in frozen}, frozen)
    # Full state (what the Trainer group checkpoints) and sharded checkpoint: the adapters and their moments.
    assert sorted(r["lora_full_state"]["model"]) == adapters
    assert r["lora_full_state"]["optimizer"]["state"] and set(r["lora_full_state"]["optimizer"]["state"]) <= set(
        adapters
    )
    assert sorted(checkpoint_model_state(r["folder"] / "lora_ckpt")) == adapters


def test_lora_on_two_ranks_resumes_identically_from_either_checkpoint(ranks: list[dict[str, Any]]) -> None:
    """Engines with other initial adapters (seed 7) load the adapters and moments saved after the first update and
    take the second update bit for bit as the engine that went on."""
    r = ranks[0]
    for how in ("sharded", "full"):
        assert r[f"lora_{how}_version"] == 1
        assert r[f"lora_{how}_metrics"][0]["loss"] == r["lora_metrics"][1]["loss"]
        assert _equal(r[f"lora_{how}_weights"], r["lora_weights"]), how


def test_lora_exports_the_merged_model_and_a_peft_adapter(ranks: list[dict[str, Any]], tmp_path: Path) -> None:
    from peft import PeftModel
    from safetensors.torch import load_file

    r = ranks[0]
    assert _equal(load_file(str(r["folder"] / "lora_hf" / "model.safetensors")), r["lora_weights"])
    peft_model = PeftModel.from_pretrained(build_tiny_omni(0).double(), r["folder"] / "lora_hf" / "adapter")
    loaded = {n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert _equal({k: v.detach() for k, v in loaded.items()}, {k: r["lora_raw"][k] for k in r["lora_trainable"]})
    # A run checkpoint of the Trainer group holds its full state: the run's export reads its adapters.
    folder = tmp_path / "step_00000001"
    folder.mkdir()
    torch.save(r["lora_full_state"], folder / ENGINE_FILE)
    out = export_checkpoint(folder, ModelConfig(lora=worker.LORA), tmp_path / "hf")
    exported = load_file(str(out / ADAPTER_FOLDER / "adapter_model.safetensors"))
    saved = {
        f"base_model.model.{k.replace('.default.', '.')}": v.float() for k, v in r["lora_full_state"]["model"].items()
    }
    assert _equal(exported, saved)


# -- checkpoints ----------------------------------------------------------------------------------------------


def test_resuming_on_two_ranks_continues_identically(ranks: list[dict[str, Any]]) -> None:
    r = ranks[0]
    assert r["resumed2_version"] == 2
    assert _equal(r["resumed2"], r["continued"])
    for a, b in zip(r["resumed2_metrics"], r["continued_metrics"], strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]


def test_resuming_on_one_rank_reshards_the_exact_state(ranks: list[dict[str, Any]]) -> None:
    r = ranks[0]
    assert r["resumed1_version"] == 2
    assert r["resumed1_lr"] == worker.CONFIG.lr
    assert _equal(r["resumed1_loaded"], r["saved_weights"])
    saved, loaded = r["saved_optimizer"]["state"], r["resumed1_optimizer"]["state"]
    assert saved.keys() == loaded.keys()  # a never-used weight still has no optimizer state
    assert "audio_tower.audio_bos_eos_token.weight" not in loaded
    for name, moments in saved.items():
        assert moments.keys() == loaded[name].keys()
        assert all(torch.equal(moments[k], loaded[name][k]) for k in moments), name
    # Continuing on one rank follows the two-rank run to the equivalence tolerance.
    assert _max_diff(r["resumed1"], r["continued"]) < ATOL


def test_full_weights_are_exported_from_the_shards(ranks: list[dict[str, Any]]) -> None:
    folder = ranks[0]["folder"]
    assert _equal(checkpoint_model_state(folder / "ckpt"), ranks[0]["saved_weights"])  # read without a group
    exported = load_model(folder / "hf").state_dict()
    assert _equal({k: exported[k] for k in ranks[0]["saved_weights"]}, ranks[0]["saved_weights"])
    assert not any(p.name.startswith(".tmp-") for p in folder.iterdir())  # temp folders renamed away


def test_loading_a_folder_without_a_checkpoint_names_it(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        checkpoint_model_state(tmp_path)


# -- bucketed weight sync -------------------------------------------------------------------------------------


def test_bucketed_sync_reproduces_the_whole_dict_exactly(ranks: list[dict[str, Any]]) -> None:
    weights = ranks[0]["weights"]
    total = sum(t.numel() * t.element_size() for t in weights.values())
    largest = max(t.numel() * t.element_size() for t in weights.values())
    assert largest > worker.SMALL_BUCKET  # the small buckets are smaller than some tensors
    for name in ("small", "large"):
        assert _equal(ranks[0][f"bucket_{name}_weights"], weights), name
        assert ranks[0][f"bucket_{name}_stats"].num_bytes == total
    assert ranks[0]["bucket_large_stats"].num_buckets == 1
    assert ranks[0]["bucket_small_stats"].num_buckets > total // largest


def test_buckets_close_before_overflowing_and_a_large_tensor_goes_alone() -> None:
    a, b, c, d = torch.ones(1), torch.ones(1), torch.ones(3), torch.ones(1)  # 4, 4, 12, 4 bytes
    named = [("a", a), ("b", b), ("c", c), ("d", d)]
    assert [[n for n, _ in bucket] for bucket in bucket_tensors(named, 8)] == [["a", "b"], ["c"], ["d"]]
    assert [[n for n, _ in bucket] for bucket in bucket_tensors(named, 16)] == [["a", "b"], ["c", "d"]]
    assert [[n for n, _ in bucket] for bucket in bucket_tensors(named, 2)] == [["a"], ["b"], ["c"], ["d"]]
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(bucket_tensors(named, 0))


def test_a_packed_bucket_unpacks_bit_exactly() -> None:
    tensors = [
        ("f", torch.randn(3, 5)),
        ("h", torch.randn(7).to(torch.bfloat16)),
        ("i", torch.arange(4, dtype=torch.int64).reshape(2, 2)),
        ("s", torch.tensor(1.5)),
    ]
    bucket = pack_bucket(3, tensors)
    assert bucket.index == 3 and bucket.num_bytes == 60 + 14 + 32 + 4
    assert [spec.offset for spec in bucket.specs] == [0, 64, 80, 112]  # aligned to 16 bytes
    out = list(unpack_bucket(bucket))
    assert [n for n, _ in out] == ["f", "h", "i", "s"]
    for (_, x), (_, y) in zip(tensors, out, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


def test_the_loader_applies_a_stream_of_an_unsharded_model_and_checks_what_arrives() -> None:
    source, target = build_tiny_omni(0), build_tiny_omni(1)
    stream = InProcessWeightStream([BucketLoader(target)])
    assert isinstance(stream, WeightStream)
    stats = stream.send(1, stream_buckets(source, 4096))
    assert _equal(target.state_dict(), source.state_dict())
    assert stats.num_buckets > 1 and stats.gb_per_s > 0

    loader = BucketLoader(target)
    with pytest.raises(KeyError, match="not a weight"):
        loader.apply(pack_bucket(0, [("nope", torch.ones(1))]))
    weight = target.lm_head.weight
    with pytest.raises(ValueError, match=r"lm_head\.weight"):
        loader.apply(pack_bucket(0, [("lm_head.weight", torch.ones(2))]))
    loader.begin()
    loader.apply(pack_bucket(0, [("lm_head.weight", weight.detach().clone())]))
    with pytest.raises(KeyError, match="twice"):
        loader.apply(pack_bucket(1, [("lm_head.weight", weight.detach().clone())]))
    with pytest.raises(KeyError, match="without"):
        loader.finish()


# -- configuration errors -------------------------------------------------------------------------------------


def test_bad_settings_are_refused_with_their_names() -> None:
    with pytest.raises(ValueError, match="mixed_precision"):
        FSDPConfig(mixed_precision="fp8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"model\.layers"):
        decoder_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"init_process_group"):
        FSDPTrainEngine(build_tiny_omni(0), dataclasses.replace(worker.CONFIG))

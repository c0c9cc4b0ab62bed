"""Run by test_engines_fsdp.py as one gloo rank of a 2-process group: trains, checkpoints and streams the
weights of :class:`FSDPTrainEngine` and saves what each rank saw to ``OUT_DIR/rank{R}.pt``.

One process group serves every scenario (starting processes that import torch and transformers is the slow
part). The batches and the loss are defined here so that the test builds the single-process reference from
the same definitions.

Usage: python _fsdp_worker.py RANK WORLD_SIZE OUT_DIR
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from relax_services.config import LoraConfig, ModelConfig
from relax_services.engines import (
    LOSS_MASK_FIELD,
    LossFn,
    LossInputs,
    LossResult,
    TorchTrainConfig,
    TrainEngine,
    TrainSample,
)
from relax_services.engines.fsdp.checkpoint import export_hf, load_checkpoint, save_checkpoint
from relax_services.engines.fsdp.train import FSDPConfig, FSDPTrainEngine, FSDPValueEngine
from relax_services.models import build_tiny_omni, build_value_model
from relax_services.models.policy import empty_policy
from relax_services.models.synthetic import synthetic_prompt
from relax_services.models.tiny_omni import tiny_omni_checkpoint
from relax_services.weights.buckets import BucketLoader, InProcessWeightStream, full_tensors, stream_buckets

# Rank 0's shares hold an image and a video, rank 1's an audio clip: the ranks use different encoders.
MODALITIES = ("image", "text", "audio", "text", "text", "video", "text", "text")
CONFIG = TorchTrainConfig(lr=1e-2, grad_clip=0.5, micro_batch_size=1, minibatches=2, seed=0)
UPDATES = 3
SMALL_BUCKET = 1024  # bytes: smaller than most weights of the tiny model (the embedding is 16 KiB)


def batch(seed: int) -> list[TrainSample]:
    """Eight samples of mixed modalities and response lengths with per-token advantages."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, kind in enumerate(MODALITIES):
        prompt = synthetic_prompt(kind, [12 + i, 40 + seed % 8], gen)
        response = torch.randint(12, 48, (2 + (i * 3 + seed) % 5,), generator=gen)
        response[-1] = 2  # eos
        adv = torch.randn(response.shape, generator=gen)
        out.append(TrainSample(prompt, response, {"advantages": adv, "reward": torch.tensor(float(i))}))
    return out


def pg_token_mean(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    loss = -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / inputs.mask.sum()
    return loss, {"mean_reward": float(inputs.fields["reward"].mean())}


def pg_kept_mean(inputs: LossInputs) -> LossResult:
    """A token mean over the tokens with a positive advantage only, with that count as its units: like masked
    IS, it keeps a data-dependent number of tokens in each micro-batch (none in some)."""
    kept = inputs.mask * (inputs.fields["advantages"] > 0)
    units = float(kept.sum())
    loss = -(inputs.logprobs * inputs.fields["advantages"] * kept).sum() / max(units, 1.0)
    return LossResult(loss, units, {"kept": units})


def _full(value: Any) -> Any:
    if isinstance(value, DTensor):
        return value.full_tensor().cpu()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    return value


def _train(engine: FSDPTrainEngine, seeds: range, loss_fn: LossFn = pg_token_mean) -> list[dict[str, float]]:
    return [engine.step(batch(s), loss_fn) for s in seeds]


def equivalence(out: dict[str, Any]) -> FSDPTrainEngine:
    engine = FSDPTrainEngine(build_tiny_omni(0), CONFIG)
    out["is_train_engine"] = isinstance(engine, TrainEngine)
    try:  # two minibatches of 3 samples: refused on every rank before any collective
        engine.step(batch(0)[:6], pg_token_mean)
    except ValueError as e:
        out["uneven_error"] = str(e)
    out["metrics"] = _train(engine, range(UPDATES))
    out["weights"] = engine.policy_state()
    out["logprobs"] = engine.compute_logprobs(batch(100))
    checkpointed = FSDPTrainEngine(build_tiny_omni(0), CONFIG, FSDPConfig(activation_checkpointing=True))
    _train(checkpointed, range(UPDATES))
    out["weights_checkpointed"] = checkpointed.policy_state()
    # Rank 1 built on the meta device (no weights read): rank 0's are broadcast into its shards.
    model = build_tiny_omni(0) if dist.get_rank() == 0 else empty_policy(ModelConfig(source="tiny-omni", seed=0))
    out["built_empty"] = any(p.is_meta for p in model.parameters())
    from_rank0 = FSDPTrainEngine(model, CONFIG)
    out["initial_from_rank0"] = from_rank0.policy_state()
    _train(from_rank0, range(UPDATES))
    out["weights_from_rank0"] = from_rank0.policy_state()
    return engine


def units(out: dict[str, Any]) -> None:
    """Micro-batches combined by the units their loss reports (each rank's own units, summed over the group); in
    float64, so that the order of float sums cannot show through AdamW's normalisation (see the test)."""
    engine = FSDPTrainEngine(build_tiny_omni(0).double(), CONFIG)
    out["units_metrics"] = _train(engine, range(2), pg_kept_mean)
    out["units_weights"] = engine.policy_state()


def masked_batch(seed: int) -> list[TrainSample]:
    """:func:`batch` with environment tokens: each sample's second token (of those with three or more) carries
    ``loss_mask`` 0, as a tool output spliced between two turns would."""
    out = []
    for sample in batch(seed):
        mask = torch.ones(sample.response_ids.shape)  # [L]
        if mask.numel() >= 3:
            mask[1] = 0.0
        out.append(TrainSample(sample.prompt, sample.response_ids, {**sample.fields, LOSS_MASK_FIELD: mask}))
    return out


def masked(out: dict[str, Any]) -> None:
    """Environment tokens on two ranks, with a plain token-mean loss: the micro-batch weights (each micro-batch's
    share of trained tokens) must count policy tokens only; in float64, as :func:`units`."""
    engine = FSDPTrainEngine(build_tiny_omni(0).double(), CONFIG)
    out["masked_metrics"] = [engine.step(masked_batch(s), pg_token_mean) for s in range(2)]
    out["masked_weights"] = engine.policy_state()


def budget(out: dict[str, Any]) -> None:
    """Token-budget micro-batches of packed responses, in float64 as :func:`units`. At 20 prompt + response tokens,
    rank 1's share of the first minibatch (32 and 8 tokens) needs two micro-batches where rank 0's (10 and 7) fits
    in one: rank 0 cuts its own in two, so that both run as many forwards."""
    config = dataclasses.replace(CONFIG, max_tokens_per_micro_batch=20, packing=True)
    engine = FSDPTrainEngine(build_tiny_omni(0).double(), config)
    out["budget_micro_batches"] = [len(engine._micro_batches(engine._share(batch(0)[:4], "train on")))]
    out["budget_metrics"] = _train(engine, range(2), pg_kept_mean)
    out["budget_weights"] = engine.policy_state()


FULL_KL_CONFIG = dataclasses.replace(CONFIG, full_kl=True)
FULL_KL_UPDATES = 2


def pg_with_full_kl(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy gradient plus 0.5 × the token mean of the engine's exact per-token KL to its reference."""
    assert inputs.full_kl is not None
    tokens = inputs.mask.sum()
    kl = (inputs.full_kl * inputs.mask).sum() / tokens
    loss = -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / tokens + 0.5 * kl
    return loss, {"kl": float(kl.detach())}


def full_kl(out: dict[str, Any]) -> None:
    """The full KL against each rank's own whole reference (other weights than the policy's: a drifted policy); in
    float64, as :func:`units`, so the comparison with one process is not AdamW-amplified float32 noise."""
    engine = FSDPTrainEngine(build_tiny_omni(0).double(), FULL_KL_CONFIG, reference=build_tiny_omni(1).double())
    out["full_kl_reference_sharded"] = any(isinstance(p, DTensor) for p in engine.root._reference.model.parameters())
    out["full_kl_metrics"] = _train(engine, range(FULL_KL_UPDATES), pg_with_full_kl)
    out["full_kl_weights"] = engine.policy_state()


def value_mse(inputs: LossInputs) -> torch.Tensor:
    assert inputs.values is not None
    return (((inputs.values - inputs.fields["advantages"]) ** 2) * inputs.mask).sum() / inputs.mask.sum()


def critic(out: dict[str, Any]) -> None:
    """The critic sharded the same way; its ``[1, H]`` value head leaves rank 1 an empty shard."""
    engine = FSDPValueEngine(build_value_model(build_tiny_omni(0)), CONFIG)
    out["critic_metrics"] = _train(engine, range(2), value_mse)
    out["critic_weights"] = engine.policy_state()
    out["critic_values"] = engine.compute_values(batch(100))


def gloo_average(out: dict[str, Any]) -> None:
    """FSDP's gradient reduction on gloo against the hand-computed average (default) and sum (divide factor 1)."""
    rank = dist.get_rank()
    inputs = [torch.randn(3, 6, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    torch.manual_seed(0)
    reference = torch.nn.Linear(6, 4)
    local = []
    for x in inputs:
        reference.zero_grad()
        (reference(x) ** 2).sum().backward()
        local.append(reference.weight.grad.clone())
    for name, factor, expected in (("average", None, (local[0] + local[1]) / 2), ("sum", 1.0, local[0] + local[1])):
        module = torch.nn.Linear(6, 4)
        module.load_state_dict(reference.state_dict())
        from torch.distributed.fsdp import fully_shard

        fully_shard(module)
        if factor is not None:
            module.set_gradient_divide_factor(factor)  # type: ignore[operator]
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
        (module(inputs[rank]) ** 2).sum().backward()
        grad = module.weight.grad
        out[f"gloo_{name}_diff"] = float((grad.full_tensor() - expected).abs().max())  # type: ignore[union-attr]


def checkpoints(out: dict[str, Any], folder: Path) -> None:
    """Save at N = 2 after two updates; continue at N = 2, and resume at N = 2 and at N = 1 (rank 0 alone)."""
    rank = dist.get_rank()
    engine = FSDPTrainEngine(build_tiny_omni(0), CONFIG)
    _train(engine, range(2))
    save_checkpoint(engine, folder / "ckpt")
    export_hf(engine, folder / "hf", side_files_from=tiny_omni_checkpoint(0))
    out["saved_weights"] = engine.policy_state()
    out["saved_optimizer"] = _full(engine.state_dict()["optimizer"])
    out["continued_metrics"] = _train(engine, range(2, 4))
    out["continued"] = engine.policy_state()

    resumed = FSDPTrainEngine(build_tiny_omni(5), CONFIG)  # other initial weights: all of them must be loaded
    load_checkpoint(resumed, folder / "ckpt")
    out["resumed2_version"] = resumed.version
    out["resumed2_metrics"] = _train(resumed, range(2, 4))
    out["resumed2"] = resumed.policy_state()

    solo = dist.new_group([0])  # every rank takes part in creating the group
    if rank == 0:
        mesh = DeviceMesh.from_group(solo, "cpu", mesh_dim_names=("dp_shard",))
        single = FSDPTrainEngine(build_tiny_omni(5), CONFIG, mesh=mesh)
        load_checkpoint(single, folder / "ckpt")
        out["resumed1_loaded"] = single.policy_state()
        out["resumed1_optimizer"] = _full(single.state_dict()["optimizer"])
        out["resumed1_version"] = single.version
        out["resumed1_lr"] = float(single.optimizer.param_groups[0]["lr"])
        out["resumed1_metrics"] = _train(single, range(2, 4))
        out["resumed1"] = single.policy_state()
        # Step times of one rank against two on the same batches (reported by the test, never asserted).
        start = time.perf_counter()
        _train(single, range(4, 6))
        out["step_s_1"] = (time.perf_counter() - start) / 2
    dist.barrier()
    start = time.perf_counter()
    _train(engine, range(4, 6))
    out["step_s_2"] = (time.perf_counter() - start) / 2


def step0_checkpoint(out: dict[str, Any], folder: Path) -> None:
    """A state dict and a checkpoint taken before the first update (a run's step-0 checkpoint) must not change
    the updates that follow, nor those of an engine resumed from it."""
    early = FSDPTrainEngine(build_tiny_omni(0), CONFIG)
    early.state_dict()
    save_checkpoint(early, folder / "ckpt0")
    out["step0_moments"] = len(early.optimizer.state)
    _train(early, range(UPDATES))
    out["step0_weights"] = early.policy_state()
    resumed = FSDPTrainEngine(build_tiny_omni(5), CONFIG)
    load_checkpoint(resumed, folder / "ckpt0")
    out["step0_resumed_moments"] = len(resumed.optimizer.state)
    _train(resumed, range(UPDATES))
    out["step0_resumed_weights"] = resumed.policy_state()


LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
LORA_CONFIG = dataclasses.replace(CONFIG, lora=LORA)
LORA_UPDATES = 2


def _lora_policy() -> torch.nn.Module:
    """The float64 tiny policy on rank 0, its empty shape on the meta device elsewhere (the ranks that receive it)."""
    if dist.get_rank() == 0:
        return build_tiny_omni(0).double()
    return empty_policy(ModelConfig(source="tiny-omni", seed=0)).double()


def lora(out: dict[str, Any], folder: Path) -> None:
    """LoRA adapters on two ranks, in float64 as :func:`units`; rank 1 is built on the meta device and receives rank
    0's weights and adapters. Two updates, a sharded checkpoint and a full state after the first; engines with other
    initial adapters (seed 7) resume from each and take the second update again; an HF export after the second; the
    same two updates with activation checkpointing."""
    engine = FSDPTrainEngine(_lora_policy(), LORA_CONFIG)
    out["lora_initial_adapters"] = engine.adapter_state()
    out["lora_initial"] = engine.policy_state()
    names = {id(p): n for n, p in engine.model.named_parameters()}
    out["lora_trainable"] = sorted(n for n, p in engine.model.named_parameters() if p.requires_grad)
    out["lora_optimized"] = sorted(names[id(p)] for g in engine.optimizer.param_groups for p in g["params"])
    out["lora_metrics"] = _train(engine, range(1))
    save_checkpoint(engine, folder / "lora_ckpt")
    full = engine.full_state_dict()
    full = [full if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(full, src=0)  # as the Trainer group hands rank 0's state to every rank
    out["lora_full_state"] = full[0]
    out["lora_metrics"] += _train(engine, range(1, LORA_UPDATES))
    out["lora_raw"] = dict(full_tensors(engine.model))  # unmerged: frozen base layers and trained adapters
    out["lora_weights"] = engine.policy_state()
    out["lora_moments"] = sorted(names[id(p)] for p in engine.optimizer.state)
    export_hf(engine, folder / "lora_hf", side_files_from=tiny_omni_checkpoint(0))
    checkpointed = FSDPTrainEngine(_lora_policy(), LORA_CONFIG, FSDPConfig(activation_checkpointing=True))
    _train(checkpointed, range(LORA_UPDATES))
    out["lora_checkpointed_weights"] = checkpointed.policy_state()  # the MLP's adapters recomputed in backward
    for how in ("sharded", "full"):
        resumed = FSDPTrainEngine(_lora_policy(), dataclasses.replace(LORA_CONFIG, seed=7))
        if how == "sharded":
            load_checkpoint(resumed, folder / "lora_ckpt")
        else:
            resumed.load_full_state_dict(full[0])
        out[f"lora_{how}_version"] = resumed.version
        out[f"lora_{how}_metrics"] = _train(resumed, range(1, LORA_UPDATES))
        out[f"lora_{how}_weights"] = resumed.policy_state()


def buckets(out: dict[str, Any], engine: FSDPTrainEngine) -> None:
    """Stream the trained weights into a fresh rollout-side model, with small and large buckets."""
    for name, size in (("small", SMALL_BUCKET), ("large", 2**30)):
        target = build_tiny_omni(7)
        stream = InProcessWeightStream([BucketLoader(target)], is_source=dist.get_rank() == 0)
        stats = stream.send(engine.version, stream_buckets(engine.model, size))
        out[f"bucket_{name}_stats"] = stats
        out[f"bucket_{name}_weights"] = {k: v.clone() for k, v in target.state_dict().items()}


def main(rank: int, world: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=world)
    try:
        out: dict[str, Any] = {}
        t0 = time.perf_counter()
        gloo_average(out)
        t1 = time.perf_counter()
        engine = equivalence(out)
        t2 = time.perf_counter()
        buckets(out, engine)
        critic(out)
        units(out)
        masked(out)
        budget(out)
        full_kl(out)
        t3 = time.perf_counter()
        lora(out, Path(out_dir))
        t4 = time.perf_counter()
        checkpoints(out, Path(out_dir))
        step0_checkpoint(out, Path(out_dir))
        out["phase_s"] = {
            "gloo": t1 - t0,
            "equivalence": t2 - t1,
            "buckets": t3 - t2,
            "lora": t4 - t3,
            "checkpoints": time.perf_counter() - t4,
        }
        torch.save(out, Path(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])

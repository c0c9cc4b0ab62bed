"""Sequence parallelism of the FSDP2 engine (Ulysses): sp = 2 on two gloo ranks against the single-process engine
on the same batches, and what each rank ran locally, which would differ if the split were skipped.

Tolerances. Not bitwise against one process: the ranks compute attention over the exchanged heads and the slices'
parameter gradients are added by FSDP's reduce-scatter, in another order than one process adds the same terms.
A float32 sum of ``n`` terms is exact to ``n · eps · Σ|terms|`` (eps = 2^-23 ≈ 1.2e-7); a gradient element here sums
at most a few dozen token terms, so ``GRAD_ATOL = 64 · eps · max|g|`` (measured: 1.8e-7 at max|g| = 0.65, about
``2 eps · max|g|``). Log-probs run through the whole model (float rounding of every layer, measured 2.9e-6): ``ATOL``.
Weights after AdamW steps: ``ATOL`` on the decoder and ``WHOLE_ATOL`` on the whole model, the tensor-parallel test's
bounds and reason (AdamW's first step divides each gradient element by its own magnitude, so near-zero gradients of
the vision patch embedding turn float-order noise into lr-sized differences; measured 9.4e-6 and 5.8e-5).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_services.engines import TorchTrainEngine
from relax_services.models import build_tiny_omni
from relax_services.models.modalities import MODEL_MODALITIES

sys.path.insert(0, str(Path(__file__).parent))  # the workers' shared batches and config
import _fsdp_worker as worker
import _sp_worker as sp_worker

EPS = torch.finfo(torch.float32).eps
ATOL = 5e-5
WHOLE_ATOL = 2e-4
LAYERS = 2  # the tiny thinker's decoder blocks
HIDDEN = 64

pytestmark = pytest.mark.timeout(600)


def _run(world: int, out: Path) -> list[dict[str, Any]]:
    script = Path(__file__).with_name("_sp_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(rank), str(world), str(out)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    try:
        errors = [p.communicate(timeout=500)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-3000:] for e in errors)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of the two sp ranks recorded."""
    return _run(2, tmp_path_factory.mktemp("sp"))


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """The single-process engine on the worker's batches: one minibatch's gradients, then the updates."""
    torch.manual_seed(0)
    engine = TorchTrainEngine(build_tiny_omni(0), worker.CONFIG)
    engine.optimizer.zero_grad(set_to_none=True)
    engine.accumulate_gradients(sp_worker.grad_batch(), worker.pg_token_mean)
    grads = {n: p.grad.detach().clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    engine.optimizer.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"grads": grads, "initial": engine.policy_state()}
    out["metrics"] = [engine.step(worker.batch(s), worker.pg_token_mean) for s in range(sp_worker.UPDATES)]
    out["weights"] = engine.policy_state()
    out["logprobs"] = engine.compute_logprobs(worker.batch(sp_worker.HELD_OUT))
    return out


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def check_equal_to_one_process(r: dict[str, Any], key: str, reference: dict[str, Any]) -> None:
    """Gradients of a minibatch, losses, token counts and weights after the updates, and held-out log-probs."""
    grads = reference["grads"]
    scale = max(float(g.abs().max()) for g in grads.values())
    assert _max_diff(r[f"{key}_grads"], grads) <= 64 * EPS * scale
    for got, want in zip(r[f"{key}_metrics"], reference["metrics"], strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert got["tokens"] == want["tokens"]  # the loss units: the whole rows' tokens, not a slice's
    expected = reference["weights"]
    assert _max_diff(expected, reference["initial"]) > 20 * WHOLE_ATOL  # the updates moved the weights past it
    decoder = [k for k in expected if k.startswith("model.layers.")]
    state = r[f"{key}_weights"]
    assert _max_diff(state, expected) < WHOLE_ATOL
    assert _max_diff({k: state[k] for k in decoder}, {k: expected[k] for k in decoder}) < ATOL
    logprobs, mask = reference["logprobs"]
    got_logprobs, got_mask = r[f"{key}_logprobs"]
    assert torch.equal(got_mask, mask)
    assert float((got_logprobs - logprobs).abs().max()) < ATOL


def expected_local_work(sp: int, samples: list[Any]) -> tuple[list[tuple[int, int, int]], int]:
    """Each held-out sample is its own micro-batch (micro_batch_size 1): a prompt forward of ``ceil(P / sp)``
    positions, then, for a response of ``L > 1`` tokens, a response forward of ``ceil((L − 1) / sp)``; every
    decoder layer exchanges q, k, v and its output (4 all-to-alls), plus the cached prompt's k and v in the
    response forward (6). Returns the decoder's input shapes and the all-to-all calls."""
    shapes: list[tuple[int, int, int]] = []
    exchanges = 0
    for s in samples:
        shapes.append((1, -(-s.prompt.num_tokens // sp), HIDDEN))
        exchanges += 4 * LAYERS
        if len(s.response_ids) > 1:
            shapes.append((1, -(-(len(s.response_ids) - 1) // sp), HIDDEN))
            exchanges += 6 * LAYERS
    return shapes, exchanges


def check_shared_encoding(group: list[dict[str, Any]], key: str, dp: int = 1) -> None:
    """In the gradient probe's micro-batch (each sp group's share of two images, two audio clips, a video and a text
    prompt), rank ``r`` of an sp group encoded the ``r``-th of ``sp`` contiguous shares of each modality's distinct
    items, not all; the video (2 temporal patches of 4 × 4, in the second half) is split along time: each of the 2
    ranks of the group that has it encoded one temporal patch."""
    samples = sp_worker.grad_batch()
    size = len(samples) // dp
    first = group[0][f"{key}_coords"]["dp"] * size
    share = samples[first : first + size]
    sp = len(group)
    items = [
        sum(1 for s in share if s.prompt.media_of(m)) for name, m in MODEL_MODALITIES.items() if name != "video"
    ]  # distinct here
    videos = sum(1 for s in share if s.prompt.media_of(MODEL_MODALITIES["video"]))
    assert videos == (1 if dp == 1 or first else 0)
    for r, rank in enumerate(group):
        expected = sum(max(0, min(-(-n // sp), n - r * -(-n // sp))) for n in items)
        assert rank[f"{key}_encoded_items"] == expected
        assert expected < sum(items) or sum(items) == 1  # a share, not everything (one item goes to one rank)
        assert rank[f"{key}_encoded_frames"] == videos * 2 // sp  # half the video's frames each, at sp = 2
    assert sum(rank[f"{key}_encoded_items"] for rank in group) == sum(items)  # every item encoded once


def check_split(group: list[dict[str, Any]], key: str, reference: dict[str, Any], dp: int = 1) -> None:
    """The ranks of one sp group (of ``dp`` data-parallel replicas) each ran their slice of their replica's share
    of the held-out batch: ``1/sp``-length decoder inputs, the all-to-alls, and LM-head rows that add up to the
    share's scored tokens (each rank fewer than all)."""
    whole = worker.batch(sp_worker.HELD_OUT)
    size = len(whole) // dp
    first = group[0][f"{key}_coords"]["dp"] * size
    shapes, exchanges = expected_local_work(len(group), whole[first : first + size])
    scored = int(reference["logprobs"][1][first : first + size].sum())
    assert [r[f"{key}_coords"]["cp"] for r in group] == list(range(len(group)))
    for r in group:
        assert r[f"{key}_block_inputs"] == shapes
        assert r[f"{key}_exchanges"] == exchanges
        assert r[f"{key}_local_tokens"] == sum(s[0] * s[1] for s in shapes)
        assert 0 < r[f"{key}_head_rows"] < scored
    assert sum(r[f"{key}_head_rows"] for r in group) == scored


def test_sp2_trains_like_one_process(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for r in ranks:
        check_equal_to_one_process(r, "sp2", reference)


def test_sp2_with_recomputed_blocks_gives_the_same_gradients(ranks: list[dict[str, Any]]) -> None:
    """Activation checkpointing under sp = 2: every block's forward (its head exchanges and the shared prompt cache
    included) runs again in the backward on the same inputs, so the gradients are the same bits."""
    for r in ranks:
        assert r["sp2ckpt_grads"].keys() == r["sp2_grads"].keys()
        assert all(torch.equal(r["sp2ckpt_grads"][n], g) for n, g in r["sp2_grads"].items())


def test_sp2_ranks_each_run_half_of_every_sequence(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    check_split(ranks, "sp2", reference)
    check_shared_encoding(ranks, "sp2")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """dp = 2 × sp = 2, sp = 2 × tp = 2 and the checkpoint scenarios on four ranks."""
    return _run(4, tmp_path_factory.mktemp("sp4"))


@pytest.mark.slow
def test_dp2_sp2_trains_like_one_process(four_ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    for r in four_ranks:
        check_equal_to_one_process(r, "dp2sp2", reference)
    # ParallelPlan.device_mesh: sp (the plan's cp) varies faster than dp, so ranks 0, 1 split one replica's rows.
    coords = [(r["dp2sp2_coords"]["dp"], r["dp2sp2_coords"]["cp"]) for r in four_ranks]
    assert coords == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check_split(four_ranks[:2], "dp2sp2", reference, dp=2)
    check_split(four_ranks[2:], "dp2sp2", reference, dp=2)
    check_shared_encoding(four_ranks[:2], "dp2sp2", dp=2)
    check_shared_encoding(four_ranks[2:], "dp2sp2", dp=2)


@pytest.mark.slow
def test_sp2_tp2_trains_like_one_process(four_ranks: list[dict[str, Any]], reference: dict[str, Any]) -> None:
    """Each tp rank holds 2 of the 4 heads and 1 of the 2 key/value heads, so the sp exchange sends the key/value
    heads expanded (one copy per query head)."""
    for r in four_ranks:
        check_equal_to_one_process(r, "sp2tp2", reference)
    # tp varies fastest: ranks 0, 2 form one sp group, ranks 1, 3 the other.
    check_split([four_ranks[0], four_ranks[2]], "sp2tp2", reference)
    check_split([four_ranks[1], four_ranks[3]], "sp2tp2", reference)
    check_shared_encoding([four_ranks[0], four_ranks[2]], "sp2tp2")
    check_shared_encoding([four_ranks[1], four_ranks[3]], "sp2tp2")


def _equal(a: Any, b: Any) -> bool:
    """Nested states with bitwise equal tensors."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp4", "dp2sp2"])
def test_an_sp_checkpoint_resumes_on_another_layout(four_ranks: list[dict[str, Any]], layout: str) -> None:
    """Saved at dp = 2 × sp = 2: the model and optimizer state come back bit for bit at dp = 4 and at dp 2 × sp 2;
    the next update continues as the saving engine's did (bitwise on the same layout, to the float order of
    another split at dp = 4: the losses within 1e-5 relative)."""
    for r in four_ranks:
        model, optimizer = r["saved_state"]
        loaded_model, loaded_optimizer = r[f"{layout}_loaded_state"]
        assert _equal(loaded_model, model)
        assert _equal(loaded_optimizer["state"], optimizer["state"])
        assert r[f"{layout}_loaded_version"] == sp_worker.UPDATES
        got, want = r[f"{layout}_continued"], r["continued"]
        if layout == "dp2sp2":
            assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
        else:
            assert got["loss"] == pytest.approx(want["loss"], rel=1e-5)
            assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)

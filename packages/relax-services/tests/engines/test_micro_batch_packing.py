"""Token-budget micro-batches and packed responses give the numbers of one padded micro-batch.

The references are the same batch as ONE padded micro-batch (nothing to combine, nothing packed). Both sides compute
the same function of the same float32 numbers and differ only in the order of their sums (other GEMM shapes, other
micro-batch boundaries, masked keys that add exact zeros). A sum of ``n`` terms is off its exact value by at most
``γ_n ≈ n·u`` of the sum of its terms' magnitudes (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1);
each side is within that of the exact result, so they differ by at most ``2·n·u`` relative to the magnitudes. ``n``
here is the sum of the reduction lengths along the longest chain an output depends on (every layer's hidden, MLP and
attention-key reductions, the batch's tokens for a weight gradient, the vocabulary's log-sum-exp), and the scale is
the largest magnitude of the compared tensor: :func:`_rounding_tol`. The same comparisons in float64 hold to
float64's ``u``, 2⁻²⁹ times tighter, which leaves no room for a mask or position that is merely close.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import pytest
import torch

from relax_services.config import RunConfig, load_run_config
from relax_services.engines import TorchTrainEngine, TrainSample, score_responses
from relax_services.engines.micro_batches import _OversizeWarning, sample_tokens, token_budget_micro_batches
from relax_services.engines.scoring import check_packing, score_values
from relax_services.engines.torch import build_train_engine
from relax_services.models import DEFAULT_SOURCE, build_tiny_omni, build_value_model, open_checkpoint, text_prompt
from relax_services.models.synthetic import synthetic_prompt
from relax_services.services.trainer import make_loss_fn

TOKENS = open_checkpoint(DEFAULT_SOURCE).tokens
SUPPRESSED_IDS = TOKENS.never_sample
RESPONSE_LENGTHS = (1, 9, 4, 12, 2, 7, 3, 11, 5, 6, 10, 8)
"""Four groups of three: lengths from 1 (no token after the prompt's last state) to 12, mixed within each group."""


def _rounding_tol(model: torch.nn.Module, batch: Sequence[TrainSample], dtype: torch.dtype) -> float:
    """``2·n·u`` (module docstring): ``n`` the reduction lengths along one output's chain, ``u`` the unit roundoff."""
    c = model.config.get_text_config()  # type: ignore[operator]
    keys = max(sample_tokens(s) for s in batch)  # the most keys a response token attends over
    tokens = sum(sample_tokens(s) for s in batch)  # a weight gradient sums over every position of the batch
    n = c.num_hidden_layers * (c.hidden_size + c.intermediate_size + keys + tokens) + c.vocab_size
    return 2 * n * torch.finfo(dtype).eps / 2


def _batch(seed: int = 0) -> list[TrainSample]:
    """GRPO-like: four prompts (one with an image) of three rows each, mixed response lengths, a suppressed id
    inside one response, and the fields the trainer's loss reads (behaviour log-probs off by noise large enough that
    masked IS rejects some tokens, so micro-batches hold different numbers of loss units)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [synthetic_prompt("image", [12, 48], gen)]
    prompts += [text_prompt(torch.randint(12, 48, (4 + 3 * g,), generator=gen).tolist()) for g in range(3)]
    out = []
    for i, n in enumerate(RESPONSE_LENGTHS):
        response = torch.randint(12, 48, (n,), generator=gen)
        if i == 3:
            response[5] = TOKENS.pad_id  # suppressed: fed as padding, never scored
        fields = {
            "old_logprobs": -3.5 + torch.randn(n, generator=gen),
            "advantages": torch.full((n,), float((-1) ** i) * (1 + i / 4)),
        }
        out.append(TrainSample(prompts[i // 3], response, fields))
    return out


def _cfg(*overrides: str) -> RunConfig:
    return load_run_config(
        None,
        [
            "trainer.groups_per_step=4",
            "trainer.micro_batch_groups=4",  # one micro-batch holding everything, unless a budget is set
            "algorithm.group_size=3",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
            "algorithm.mis_level=token",
            "algorithm.kl_coef=0.0",
            "algorithm.entropy_coef=0.01",
            *overrides,
        ],
    )


def _gradients(cfg: RunConfig) -> tuple[TorchTrainEngine, dict[str, torch.Tensor], dict[str, float]]:
    engine = build_train_engine(cfg)
    metrics = engine.accumulate_gradients(_batch(), make_loss_fn(cfg))
    grads = {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}
    return engine, grads, metrics


def _assert_close_scaled(got: torch.Tensor, want: torch.Tensor, tol: float, name: str) -> None:
    scale = float(want.detach().abs().max())
    torch.testing.assert_close(got.detach(), want.detach(), atol=tol * max(scale, 1e-30), rtol=0, msg=name)


def _indices(batch: Sequence[TrainSample], micro: Sequence[Sequence[TrainSample]]) -> list[list[int]]:
    where = {id(s): i for i, s in enumerate(batch)}
    return [[where[id(s)] for s in m] for m in micro]


# -- the micro-batches a budget makes -------------------------------------------------------------------------------


def test_budget_cuts_consecutive_micro_batches_and_keeps_an_oversize_sample_alone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Hand-made costs (prompt + response tokens): 5+3, 5+4, 5+9, 2+30, 2+1, 2+2 = 8, 9, 14, 32, 3, 4 at a budget of
    20: [8, 9] (the 14 would overflow), [14], [32] alone (over the budget, logged once), [3, 4]."""
    long_prompt, short_prompt = text_prompt([20] * 5), text_prompt([21] * 2)
    responses = [3, 4, 9, 30, 1, 2]
    batch = [TrainSample(long_prompt if i < 3 else short_prompt, torch.full((n,), 22)) for i, n in enumerate(responses)]
    assert [sample_tokens(s) for s in batch] == [8, 9, 14, 32, 3, 4]
    _OversizeWarning.warned = False
    with caplog.at_level(logging.WARNING, logger="relax_services.engines.micro_batches"):
        micro = token_budget_micro_batches(batch, 20)
        token_budget_micro_batches(batch, 20)  # the same oversize sample again: not logged twice
    assert _indices(batch, micro) == [[0, 1], [2], [3], [4, 5]]
    assert len([r for r in caplog.records if "exceeds trainer.max_tokens_per_micro_batch=20" in r.message]) == 1
    # Ranks that must run as many forwards: the widest micro-batches are halved, each still within the budget.
    assert _indices(batch, token_budget_micro_batches(batch, 20, count=6)) == [
        [0],
        [1],
        [2],
        [3],
        [4],
        [5],
    ]
    assert [len(m) for m in token_budget_micro_batches(batch, 20, count=5)] == [1, 1, 1, 1, 2]
    with pytest.raises(ValueError, match="cannot cut 6 samples into 3 micro-batches"):
        token_budget_micro_batches(batch, 20, count=3)


def test_config_reaches_the_engine_and_refuses_a_bad_budget() -> None:
    cfg = _cfg("trainer.max_tokens_per_micro_batch=64", "trainer.packing=true")
    engine = build_train_engine(cfg)
    assert engine.config.max_tokens_per_micro_batch == 64 and engine.config.packing
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch"):
        _cfg("trainer.max_tokens_per_micro_batch=0")


def test_packing_refuses_an_attention_without_a_dense_mask() -> None:
    model = build_tiny_omni(0)
    check_packing(model)  # sdpa
    model.config.get_text_config()._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"trainer\.packing needs the decoder's attention"):
        check_packing(model)


# -- exactness ----------------------------------------------------------------------------------------------------


def test_token_budget_micro_batches_give_the_one_micro_batch_loss_and_gradient() -> None:
    """A 30-token budget (samples of 6 to 20 prompt + response tokens) cuts groups apart and joins rows of different
    prompts; with the loss's data-dependent units (masked IS) the accumulation is still the one batch's."""
    _, whole, whole_metrics = _gradients(_cfg())
    engine, split, split_metrics = _gradients(_cfg("trainer.max_tokens_per_micro_batch=30"))
    micro = engine.config.micro_batches(_batch())
    # Samples 0..11 cost 9, 17, 12, 16, 6, 11, 10, 18, 12, 16, 20, 18: [0, 1] [2, 3] [4, 5, 6] [7, 8] [9] [10] [11].
    assert [[sample_tokens(s) for s in m] for m in micro] == [
        [9, 17],
        [12, 16],
        [6, 11, 10],
        [18, 12],
        [16],
        [20],
        [18],
    ]
    assert 0.05 < whole_metrics["is_masked_frac"] < 0.95
    tol = _rounding_tol(engine.model, _batch(), torch.float32)
    assert whole.keys() == split.keys()
    for name in whole:
        _assert_close_scaled(split[name], whole[name], tol, name)
    assert split_metrics["loss"] == pytest.approx(whole_metrics["loss"], rel=tol, abs=tol)
    assert split_metrics["tokens"] == whole_metrics["tokens"]


@pytest.mark.parametrize(
    ("attention", "dtype"), [("sdpa", torch.float32), ("sdpa", torch.float64), ("eager", torch.float32)]
)
def test_packed_scores_and_gradients_equal_the_padded_ones(attention: str, dtype: torch.dtype) -> None:
    """Log-probs, entropy and the gradient of ``Σ a·logprobs + b·entropy`` of every parameter, packed vs right-padded
    (the image prompt's rows included). Eager attention is compared in float32 only: transformers' eager attention
    gives NaN on left-padded prompts in float64 (its float32 softmax of the float64 mask minimum), padded or not."""
    model = build_tiny_omni(0).to(dtype)
    model.set_attn_implementation(attention)
    batch = _batch()
    prompts, responses = [s.prompt for s in batch], [s.response_ids for s in batch]
    gen = torch.Generator().manual_seed(1)
    a, b = (
        torch.randn(len(batch), 12, generator=gen, dtype=dtype),
        torch.randn(len(batch), 12, generator=gen, dtype=dtype),
    )
    results = []
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        scores = score_responses(model, prompts, responses, suppressed_ids=SUPPRESSED_IDS, packed=packed)
        ((a * scores.logprobs).sum() + (b * scores.entropy).sum()).backward()
        results.append((scores, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (padded, g_padded), (packed_, g_packed) = results
    tol = _rounding_tol(model, batch, dtype)
    assert torch.equal(packed_.mask, padded.mask) and padded.mask.sum() == sum(RESPONSE_LENGTHS) - 1
    _assert_close_scaled(packed_.logprobs, padded.logprobs, tol, "logprobs")
    _assert_close_scaled(packed_.entropy, padded.entropy, tol, "entropy")
    assert g_packed.keys() == g_padded.keys()
    for name in g_padded:
        _assert_close_scaled(g_packed[name], g_padded[name], tol, name)


def test_packed_values_equal_the_padded_ones() -> None:
    critic = build_value_model(build_tiny_omni(0))
    with torch.no_grad():
        critic.value_head.weight.normal_(generator=torch.Generator().manual_seed(2))
    batch = _batch()
    prompts, responses = [s.prompt for s in batch], [s.response_ids for s in batch]
    with torch.no_grad():
        padded = score_values(critic, prompts, responses, SUPPRESSED_IDS)
        packed = score_values(critic, prompts, responses, SUPPRESSED_IDS, packed=True)
    assert padded.values is not None and packed.values is not None
    _assert_close_scaled(packed.values, padded.values, _rounding_tol(critic.thinker, batch, torch.float32), "values")


def test_packed_token_budget_update_equals_one_padded_micro_batch_and_reports_its_padding() -> None:
    """The whole path (config → engine → loss units → backward): packed 30-token micro-batches against one padded
    micro-batch. ``padding_frac`` by hand: one padded micro-batch runs 12 rows × 12 positions for 78 real tokens
    (66 padding positions); packed runs none."""
    _, whole, whole_metrics = _gradients(_cfg())
    engine, split, split_metrics = _gradients(_cfg("trainer.max_tokens_per_micro_batch=30", "trainer.packing=true"))
    tol = _rounding_tol(engine.model, _batch(), torch.float32)
    for name in whole:
        _assert_close_scaled(split[name], whole[name], tol, name)
    assert split_metrics["loss"] == pytest.approx(whole_metrics["loss"], rel=tol, abs=tol)
    assert sum(RESPONSE_LENGTHS) == 78
    assert whole_metrics["padding_frac"] == pytest.approx((12 * 12 - 78) / 78)
    assert split_metrics["padding_frac"] == 0.0
    start = time.perf_counter()
    engine.step(_batch(), make_loss_fn(_cfg()))
    assert time.perf_counter() - start < 20  # the whole update, packed, stays a unit test's size

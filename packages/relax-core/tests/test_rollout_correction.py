"""Rollout (off-policy) correction: sequence-level truncated IS, batch-normalised IS and verl's ``rollout_rs``
rejection rules, against plain-Python re-computations on seeded log-probs with padding and a hole in the mask."""

from __future__ import annotations

import math

import pytest
import torch

import relax_core as rc

MASK = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 0], [0, 0, 0, 0, 0]]  # padding, a hole, an empty row
B, T = len(MASK), len(MASK[0])


def _logprobs(seed: int) -> tuple[list[list[float]], list[list[float]]]:
    gen = torch.Generator().manual_seed(seed)
    behaviour = (-0.1 - 2.0 * torch.rand(B, T, generator=gen, dtype=torch.float64)).tolist()
    shift = (0.35 * torch.randn(B, T, generator=gen, dtype=torch.float64)).tolist()
    proximal = [[b + s for b, s in zip(br, sr, strict=True)] for br, sr in zip(behaviour, shift, strict=True)]
    return proximal, behaviour


def _log_w(proximal: list[list[float]], behaviour: list[list[float]], b: int, t: int) -> float:
    return proximal[b][t] - behaviour[b][t]


def _weights(seed: int, **kwargs: object) -> rc.ImportanceWeights:
    proximal, behaviour = _logprobs(seed)
    return rc.importance_weights(
        torch.tensor(proximal, dtype=torch.float64),
        torch.tensor(behaviour, dtype=torch.float64),
        torch.tensor(MASK),
        **kwargs,  # type: ignore[arg-type]
    )


@pytest.mark.parametrize("seed", range(4))
def test_sequence_level_truncated_is(seed: int) -> None:
    proximal, behaviour = _logprobs(seed)
    iw = _weights(seed, tis_cap=1.5, tis_level="sequence", tis_cap_low=0.6)
    for b in range(B):
        raw = math.exp(sum(_log_w(proximal, behaviour, b, t) for t in range(T) if MASK[b][t]))
        capped = min(max(raw, 0.6), 1.5)
        for t in range(T):
            assert iw.raw[b, t].item() == pytest.approx(raw, rel=1e-12)
            assert iw.weights[b, t].item() == pytest.approx(capped, rel=1e-12)
            assert bool(iw.truncated[b, t]) == bool(MASK[b][t] and capped != raw)


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("seed", range(3))
def test_batch_normalised_is(seed: int, level: str) -> None:
    proximal, behaviour = _logprobs(seed)
    iw = _weights(seed, tis_cap=1.3, tis_level=level, batch_normalize=True)
    if level == "token":
        capped = {
            (b, t): min(math.exp(_log_w(proximal, behaviour, b, t)), 1.3)
            for b in range(B)
            for t in range(T)
            if MASK[b][t]
        }
        mean = sum(capped.values()) / len(capped)
        for (b, t), w in capped.items():
            assert iw.weights[b, t].item() == pytest.approx(w / mean, rel=1e-12)
        assert sum(iw.weights[b, t].item() for b, t in capped) / len(capped) == pytest.approx(1.0, rel=1e-12)
    else:
        rows = [b for b in range(B) if any(MASK[b])]
        seq = {
            b: min(math.exp(sum(_log_w(proximal, behaviour, b, t) for t in range(T) if MASK[b][t])), 1.3) for b in rows
        }
        mean = sum(seq.values()) / len(seq)
        for b in rows:
            assert iw.weights[b, 0].item() == pytest.approx(seq[b] / mean, rel=1e-12)


def _divergences(lw: float) -> dict[str, float]:
    return {"k1": -lw, "k2": 0.5 * lw * lw, "k3": math.exp(lw) - 1.0 - lw}


def _reference_keep(option: str, lower: float | None, upper: float, proximal, behaviour) -> list[list[bool]]:
    level, _, estimator = option.rpartition("_")
    keep = [[True] * T for _ in range(B)]
    for b in range(B):
        values = [_divergences(_log_w(proximal, behaviour, b, t))[estimator] for t in range(T) if MASK[b][t]]
        if level == "token":
            stats = [_divergences(_log_w(proximal, behaviour, b, t))[estimator] for t in range(T)]
        else:
            agg = {
                "seq_sum": sum,
                "seq_mean": lambda v: sum(v) / max(len(v), 1),
                "seq_max": lambda v: max(v, default=0.0),
            }
            stats = [agg[level](values)] * T
        for t in range(T):
            s = stats[t]
            keep[b][t] = math.log(lower) <= s <= math.log(upper) if lower is not None else s <= upper
    return keep


CASES = [
    ("token_k1", "0.7_1.25"),
    ("token_k3", "0.03"),
    ("seq_mean_k3", "0.04"),
    ("seq_sum_k1", "0.5_2.0"),
    ("seq_max_k2", "0.08"),
    ("seq_sum_k3", "0.1"),
    ("token_k2", "0.02"),
]


@pytest.mark.parametrize(("option", "threshold"), CASES)
@pytest.mark.parametrize("seed", range(3))
def test_each_rejection_rule(option: str, threshold: str, seed: int) -> None:
    proximal, behaviour = _logprobs(seed)
    cfg = rc.AlgorithmConfig(decoupled=True, rollout_rs=option, rollout_rs_threshold=threshold)
    ((name, lower, upper),) = cfg.rollout_rs_rules
    assert name == option
    want = _reference_keep(option, lower, upper, proximal, behaviour)
    iw = _weights(seed, rejection=cfg.rollout_rs_rules)
    assert seed == 0 or 0 < int(iw.rejected.sum()) < int(torch.tensor(MASK).sum())  # the rule decides something
    for b in range(B):
        for t in range(T):
            assert bool(iw.keep[b, t]) == (bool(MASK[b][t]) and want[b][t]), (b, t)
            assert bool(iw.rejected[b, t]) == (bool(MASK[b][t]) and not want[b][t])


def test_combined_rules_and_the_rejected_share_metric() -> None:
    proximal, behaviour = _logprobs(1)
    cfg = rc.AlgorithmConfig(decoupled=True, rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.8_1.25,0.03")
    assert cfg.rollout_rs_rules == (("token_k1", 0.8, 1.25), ("seq_mean_k3", None, 0.03))
    a = _reference_keep("token_k1", 0.8, 1.25, proximal, behaviour)
    c = _reference_keep("seq_mean_k3", None, 0.03, proximal, behaviour)
    valid = [(b, t) for b in range(B) for t in range(T) if MASK[b][t]]
    rejected = [(b, t) for b, t in valid if not (a[b][t] and c[b][t])]
    assert 0 < len(rejected) < len(valid)
    prox = torch.tensor(proximal, dtype=torch.float64)
    old = torch.tensor(behaviour, dtype=torch.float64)
    adv = torch.ones(B, T, dtype=torch.float64)
    mask = torch.tensor(MASK, dtype=torch.float64)
    _, diag = rc.compute_policy_loss(cfg, prox.clone().requires_grad_(), old, adv, mask, proximal_logprobs=prox)
    assert diag["rs_masked_frac"] == pytest.approx(len(rejected) / len(valid))
    rows = [b for b in range(B) if any(MASK[b])]
    assert diag["rs_seq_masked_frac"] == pytest.approx(len({b for b, _ in rejected}) / len(rows))
    # A rejected token leaves the loss: with A = 1 at ratio 1 the token-mean loss is −1 over the kept tokens.
    kept = len(valid) - len(rejected)
    assert rc.policy_loss_units(cfg, old, mask, prox) == kept


def test_k1_single_threshold_is_symmetric_and_config_errors_name_the_field() -> None:
    cfg = rc.AlgorithmConfig(decoupled=True, rollout_rs="token_k1,token_k3", rollout_rs_threshold=2.0)
    assert cfg.rollout_rs_rules == (("token_k1", 0.5, 2.0), ("token_k3", None, 2.0))
    for bad, match in [
        ({"rollout_rs": "token_k4", "rollout_rs_threshold": 1.0}, "rollout_rs"),
        ({"rollout_rs": "token_k3"}, "rollout_rs_threshold"),
        ({"rollout_rs": "token_k3,seq_max_k2", "rollout_rs_threshold": "1,2,3"}, "rollout_rs_threshold"),
    ]:
        with pytest.raises(rc.ConfigError, match=match):
            rc.load_config(rc.AlgorithmConfig, {"decoupled": True, **bad})
    with pytest.raises(rc.ConfigError, match="decoupled"):
        rc.load_config(rc.AlgorithmConfig, {"tis_level": "sequence", "tis_cap": 2.0})

"""The policy losses beyond PPO (gpg, reinforce, dro, geo_mean, clip_cov, kl_cov, dppo_tv, dppo_kl): the value and
the gradient of :func:`relax_core.compute_policy_loss` against a re-computation in plain Python on seeded inputs with
padding and a hole in the mask."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import relax_core as rc

B, T = 3, 5
MASK = [[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [1, 0, 1, 1, 0]]  # row 0 padded, row 2 with a hole
EPS_LOW, EPS_HIGH = 0.2, 0.25


def _inputs(seed: int, seq_adv: bool = False) -> tuple[list[list[float]], list[list[float]], list[list[float]]]:
    gen = torch.Generator().manual_seed(seed)
    old = (-0.2 - 2.0 * torch.rand(B, T, generator=gen, dtype=torch.float64)).tolist()
    step = (0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).tolist()
    logp = [[min(o + s, -1e-3) for o, s in zip(orow, srow, strict=True)] for orow, srow in zip(old, step, strict=True)]
    adv_rows = torch.randn(B, T if not seq_adv else 1, generator=gen, dtype=torch.float64)
    adv = adv_rows.expand(B, T).tolist()
    return logp, old, adv


def _run(cfg: rc.AlgorithmConfig, logp: list[list[float]], old: list[list[float]], adv: list[list[float]]):
    leaf = torch.tensor(logp, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor(MASK, dtype=torch.float64)
    # Padding holds garbage that must not reach the loss or the gradient.
    garbage = torch.where(mask.bool(), torch.tensor(old, dtype=torch.float64), torch.tensor(-math.inf))
    loss, diag = rc.compute_policy_loss(cfg, leaf, garbage, torch.tensor(adv, dtype=torch.float64), mask)
    loss.backward()
    assert leaf.grad is not None
    return loss.item(), leaf.grad.tolist(), diag


def _token_mean(per_token: Callable[[int, int], float]) -> float:
    cells = [(b, t) for b in range(B) for t in range(T) if MASK[b][t]]
    return sum(per_token(b, t) for b, t in cells) / len(cells)


def _valid_count() -> int:
    return sum(map(sum, MASK))


def _check(got_loss: float, got_grad: list[list[float]], loss: float, grad: Callable[[int, int], float]) -> None:
    assert got_loss == pytest.approx(loss, rel=1e-12, abs=1e-12)
    n = _valid_count()
    want = [[grad(b, t) / n if MASK[b][t] else 0.0 for t in range(T)] for b in range(B)]
    for got_row, want_row in zip(got_grad, want, strict=True):
        assert got_row == pytest.approx(want_row, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("name", ["gpg", "reinforce"])
@pytest.mark.parametrize("seed", range(3))
def test_plain_policy_gradient(name: str, seed: int) -> None:
    logp, old, adv = _inputs(seed)
    got = _run(rc.AlgorithmConfig(policy_loss=name), logp, old, adv)
    _check(got[0], got[1], _token_mean(lambda b, t: -adv[b][t] * logp[b][t]), lambda b, t: -adv[b][t])


@pytest.mark.parametrize("seed", range(3))
def test_dro(seed: int) -> None:
    logp, old, adv = _inputs(seed)
    beta = 0.7
    got = _run(rc.AlgorithmConfig(policy_loss="dro", dro_beta=beta), logp, old, adv)

    def lr(b: int, t: int) -> float:
        return logp[b][t] - old[b][t]

    loss = _token_mean(lambda b, t: -(adv[b][t] * logp[b][t] - 0.5 * beta * lr(b, t) ** 2))
    _check(got[0], got[1], loss, lambda b, t: -adv[b][t] + beta * lr(b, t))


def _dppo_keep(kind: str, lp: float, o: float, a: float) -> bool:
    p, q = math.exp(lp), math.exp(o)
    if kind == "tv":
        return p - q <= EPS_HIGH if a > 0 else p - q >= -EPS_LOW
    d = q * (o - lp) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return (d <= EPS_HIGH or p <= q) if a > 0 else (d <= EPS_LOW or p >= q)


@pytest.mark.parametrize("kind", ["tv", "kl"])
@pytest.mark.parametrize("seed", range(4))
def test_dppo(kind: str, seed: int) -> None:
    logp, old, adv = _inputs(seed)
    # One token pushed up past δ_high with A > 0, one pushed down past δ_low with A < 0: both leave the region.
    logp[1][2], adv[1][2] = math.log(min(math.exp(old[1][2]) + 0.45, 0.999)), 1.0
    old[1][3], adv[1][3] = math.log(0.6), -1.0
    logp[1][3] = old[1][3] - 1.5
    cap = 1.3
    cfg = rc.AlgorithmConfig(
        policy_loss=f"dppo_{kind}", clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, dppo_ratio_cap=cap
    )
    got = _run(cfg, logp, old, adv)

    def weight(b: int, t: int) -> float:
        keep = _dppo_keep(kind, logp[b][t], old[b][t], adv[b][t])
        return min(math.exp(logp[b][t] - old[b][t]), cap) if keep else 0.0

    _check(got[0], got[1], _token_mean(lambda b, t: -adv[b][t] * weight(b, t) * logp[b][t]),
           lambda b, t: -adv[b][t] * weight(b, t))  # fmt: skip
    outside = [not _dppo_keep(kind, logp[b][t], old[b][t], adv[b][t]) for b in range(B) for t in range(T) if MASK[b][t]]
    assert 0 < sum(outside) < len(outside)
    assert got[2]["clip_frac"] == pytest.approx(sum(outside) / len(outside))


@pytest.mark.parametrize("seed", range(4))
def test_geo_mean(seed: int) -> None:
    logp, old, adv = _inputs(seed, seq_adv=True)
    logp[1][0] = old[1][0] + 0.6  # beyond ε_high
    logp[1][4] = old[1][4] - 0.5  # beyond ε_low
    cfg = rc.AlgorithmConfig(
        policy_loss="geo_mean", clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, loss_agg_mode="seq-mean-token-mean"
    )
    got = _run(cfg, logp, old, adv)
    seq_loss, grad = [], [[0.0] * T for _ in range(B)]
    for b in range(B):
        cells = [t for t in range(T) if MASK[b][t]]
        a = sum(adv[b][t] for t in cells) / len(cells)
        s = (a > 0) - (a < 0)
        kept, logs = [], []
        for t in cells:
            lr = logp[b][t] - old[b][t]
            clipped = min(max(lr, -EPS_LOW), EPS_HIGH)
            unclipped_side = s * lr <= s * clipped
            logs.append(lr if unclipped_side else clipped)
            kept.append((t, unclipped_side))
        rho = math.exp(sum(logs) / len(cells))
        seq_loss.append(-a * rho)
        for t, free in kept:  # d(−Ā ρ)/d log π_t = −Ā ρ / n_b on the unclipped side; mean over B sequences
            grad[b][t] = -a * rho / len(cells) / B if free else 0.0
    assert got[0] == pytest.approx(sum(seq_loss) / B, rel=1e-12)
    for got_row, want_row in zip(got[1], grad, strict=True):
        assert got_row == pytest.approx(want_row, rel=1e-9, abs=1e-12)


def _cov(logp: list[list[float]], adv: list[list[float]]) -> dict[tuple[int, int], float]:
    cells = [(b, t) for b in range(B) for t in range(T) if MASK[b][t]]
    mean_a = sum(adv[b][t] for b, t in cells) / len(cells)
    mean_lp = sum(logp[b][t] for b, t in cells) / len(cells)
    return {(b, t): (adv[b][t] - mean_a) * (logp[b][t] - mean_lp) for b, t in cells}


def _ppo_token(lp: float, o: float, a: float) -> tuple[float, float, bool]:
    """PPO's loss, its gradient w.r.t. log π and whether the clip is active, for one token."""
    r = math.exp(lp - o)
    unclipped, clipped = -a * r, -a * min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH)
    return max(unclipped, clipped), (-a * r if unclipped >= clipped else 0.0), clipped > unclipped


@pytest.mark.parametrize("seed", range(4))
def test_clip_cov_cuts_every_candidate_when_the_ratio_allows(seed: int) -> None:
    logp, old, adv = _inputs(seed)
    cov = _cov(logp, adv)
    ranked = sorted(cov.values())
    low, high = (ranked[2] + ranked[3]) / 2, (ranked[-3] + ranked[-2]) / 2  # holds some tokens, none at its edges
    cfg = rc.AlgorithmConfig(
        policy_loss="clip_cov", clip_eps_low=EPS_LOW, clip_eps_high=EPS_HIGH, clip_cov_ratio=1.0,
        clip_cov_lb=low, clip_cov_ub=high,
    )  # fmt: skip
    got = _run(cfg, logp, old, adv)

    def cut(b: int, t: int) -> bool:
        return not _ppo_token(logp[b][t], old[b][t], adv[b][t])[2] and low < cov[b, t] < high

    assert any(cut(b, t) for b, t in cov)
    loss = _token_mean(lambda b, t: 0.0 if cut(b, t) else _ppo_token(logp[b][t], old[b][t], adv[b][t])[0])
    _check(got[0], got[1], loss, lambda b, t: 0.0 if cut(b, t) else _ppo_token(logp[b][t], old[b][t], adv[b][t])[1])


def test_clip_cov_draws_max_one_ratio_n_of_the_candidates() -> None:
    logp, old, adv = _inputs(0)
    mask = torch.tensor(MASK, dtype=torch.float64)
    args = (torch.tensor(logp, dtype=torch.float64) - torch.tensor(old, dtype=torch.float64),
            torch.tensor(logp, dtype=torch.float64), torch.tensor(adv, dtype=torch.float64), mask)  # fmt: skip
    ppo, clipped, _ = rc.ppo_clip_loss(args[0], args[2], EPS_LOW, EPS_HIGH)
    candidates = mask.bool() & ~clipped
    torch.manual_seed(0)
    loss, flagged = rc.clip_cov_loss(*args, EPS_LOW, EPS_HIGH, ratio=0.2, cov_low=-1e9, cov_high=1e9)
    cut = flagged & ~clipped
    assert int(cut.sum()) == int(0.2 * mask.sum())  # ⌊0.2 · 10⌋ = 2
    assert bool((cut <= candidates).all())
    torch.testing.assert_close(loss, torch.where(cut, torch.zeros_like(ppo), ppo))


@pytest.mark.parametrize("seed", range(4))
def test_kl_cov(seed: int) -> None:
    logp, old, adv = _inputs(seed)
    coef = 0.8
    cfg = rc.AlgorithmConfig(policy_loss="kl_cov", kl_cov_ratio=0.2, ppo_kl_coef=coef)
    got = _run(cfg, logp, old, adv)
    cov = _cov(logp, adv)
    top = set(sorted(cov, key=lambda cell: -cov[cell])[: int(0.2 * _valid_count())])  # 2 of 10

    def lr(b: int, t: int) -> float:
        return logp[b][t] - old[b][t]

    def value(b: int, t: int) -> float:
        return -adv[b][t] * math.exp(lr(b, t)) + (coef * abs(lr(b, t)) if (b, t) in top else 0.0)

    def grad(b: int, t: int) -> float:
        return -adv[b][t] * math.exp(lr(b, t)) + (coef * math.copysign(1.0, lr(b, t)) if (b, t) in top else 0.0)

    _check(got[0], got[1], _token_mean(value), grad)
    assert got[2]["clip_frac"] == pytest.approx(2 / _valid_count())


def test_every_policy_loss_is_a_config_value() -> None:
    for name in rc.POLICY_LOSSES:
        assert rc.load_config(rc.AlgorithmConfig, {"policy_loss": name}).policy_loss == name
    with pytest.raises(rc.ConfigError, match="policy_loss"):
        rc.load_config(rc.AlgorithmConfig, {"policy_loss": "vanilla2"})

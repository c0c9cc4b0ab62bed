"""KL estimator forms (abs, the straight-through k1+/k3+, verl's aliases): values and gradients by hand."""

from __future__ import annotations

import math

import pytest
import torch

import relax_core as rc

# d = log π_θ − log π_ref per token; the estimators are functions of d alone.
LOGP = [-1.0, -0.5, -2.0, -0.1]
REF = [-1.5, -0.5, -0.2, -0.3]
D = [lp - r for lp, r in zip(LOGP, REF, strict=True)]  # [0.5, 0.0, -1.8, 0.2]

VALUE = {
    "k1": lambda d: d,
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: math.exp(-d) - 1.0 + d,
    "abs": abs,
}
GRAD = {  # d estimate / d log π_θ
    "k1": lambda d: 1.0,
    "k2": lambda d: d,
    "k3": lambda d: 1.0 - math.exp(-d),
    "abs": lambda d: float((d > 0) - (d < 0)),
}
# (estimator, the form its value takes, the form its gradient takes)
FORMS = [
    ("k1", "k1", "k1"),
    ("k2", "k2", "k2"),
    ("k3", "k3", "k3"),
    ("abs", "abs", "abs"),
    ("k1+", "k1", "k2"),
    ("k3+", "k3", "k2"),
    ("kl", "k1", "k1"),
    ("mse", "k2", "k2"),
    ("low_var_kl", "k3", "k3"),
]


@pytest.mark.parametrize(("estimator", "value_form", "grad_form"), FORMS)
def test_value_and_gradient_by_hand(estimator: str, value_form: str, grad_form: str) -> None:
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    kl = rc.kl_estimate(logp, torch.tensor(REF, dtype=torch.float64), estimator, clamp=None)  # type: ignore[arg-type]
    kl.sum().backward()
    assert logp.grad is not None
    assert kl.tolist() == pytest.approx([VALUE[value_form](d) for d in D], abs=1e-12)
    assert logp.grad.tolist() == pytest.approx([GRAD[grad_form](d) for d in D], abs=1e-12)


def test_straight_through_clamps_its_value_not_its_gradient() -> None:
    # d = 15: k3 = e^-15 − 1 + 15 ≈ 14 is clamped to 10; the gradient stays k2's, d = 15.
    logp = torch.tensor([0.0], requires_grad=True)
    kl = rc.kl_estimate(logp, torch.tensor([-15.0]), "k3+", clamp=10.0)
    kl.sum().backward()
    assert kl.item() == 10.0
    assert logp.grad is not None and logp.grad.item() == pytest.approx(15.0)


def test_config_accepts_each_name_and_the_loss_uses_its_gradient() -> None:
    # kl_coef·token-mean of k3+ with a hole in the mask: gradient β·d/N on valid tokens, 0 on the hole.
    logp = torch.tensor([LOGP], requires_grad=True)
    ref = torch.tensor([REF])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    cfg = rc.AlgorithmConfig(kl_coef=0.5, kl_estimator="k3+")
    zeros = torch.zeros_like(ref)
    loss, diag = rc.compute_policy_loss(cfg, logp, logp.detach(), zeros, mask, ref_logprobs=ref)
    loss.backward()
    valid = [d for d, m in zip(D, [1, 1, 0, 1], strict=True) if m]
    assert diag["kl"] == pytest.approx(sum(VALUE["k3"](d) for d in valid) / 3, rel=1e-6)
    want = [0.5 * d / 3 * m for d, m in zip(D, [1, 1, 0, 1], strict=True)]
    assert logp.grad is not None and logp.grad[0].tolist() == pytest.approx(want, abs=1e-7)
    for name in ("abs", "k1+", "k3+", "kl", "mse", "low_var_kl"):
        assert rc.load_config(rc.AlgorithmConfig, {"kl_estimator": name}).kl_estimator == name
    with pytest.raises(rc.ConfigError, match="kl_estimator"):
        rc.load_config(rc.AlgorithmConfig, {"kl_estimator": "k4"})

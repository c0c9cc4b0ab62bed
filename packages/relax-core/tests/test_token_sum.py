"""``token-sum`` aggregation and the Dr.GRPO normaliser fixed by a constant, not by the batch's padded width."""

from __future__ import annotations

import pytest
import torch

import relax_core as rc


def test_token_sum_hand_values_and_units() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 0.0]])
    mask = torch.tensor([[1, 0, 1], [1, 0, 0]])
    assert rc.aggregate_loss(loss, mask, "token-sum").item() == pytest.approx(1 + 3 + 4)
    # Parts count one each: the batch's sum over two parts combines as the mean of the parts' sums.
    assert rc.aggregation_units(mask, "token-sum") == 1.0
    assert rc.load_config(rc.AlgorithmConfig, {"loss_agg_mode": "token-sum"}).loss_agg_mode == "token-sum"


def _row0_gradient(other_row_length: int, constant: int | None) -> torch.Tensor:
    """Gradient of the seq-mean-token-sum-norm policy loss on row 0 (3 tokens) when row 1 has
    ``other_row_length`` tokens: the padded width is max(3, that length)."""
    width = max(3, other_row_length)
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(2, width, generator=gen, dtype=torch.float64)
    logp = (old + 0.1).requires_grad_()
    adv = torch.tensor([[1.0] * width, [-1.0] * width], dtype=torch.float64)
    mask = torch.zeros(2, width, dtype=torch.float64)
    mask[0, :3] = 1
    mask[1, :other_row_length] = 1
    cfg = rc.AlgorithmConfig(loss_agg_mode="seq-mean-token-sum-norm", loss_norm_constant=constant, clip_eps_high=1.0)
    loss, _ = rc.compute_policy_loss(cfg, logp, old, adv, mask)
    loss.backward()
    assert logp.grad is not None
    return logp.grad[0, :3]


def test_dr_grpo_constant_does_not_move_when_another_row_gets_longer() -> None:
    # d loss / d logp_{0,t} = −A·r_t / (B·C): with C fixed it is the same whatever row 1's length.
    short, long = _row0_gradient(2, constant=16), _row0_gradient(9, constant=16)
    torch.testing.assert_close(short, long, rtol=0.0, atol=0.0)
    ratio = torch.exp(torch.tensor(0.1, dtype=torch.float64))
    torch.testing.assert_close(short, torch.full((3,), -float(ratio) / (2 * 16), dtype=torch.float64))
    # Without the constant, the padded width (3, then 9) is the divisor: row 0's gradient shrinks threefold.
    torch.testing.assert_close(_row0_gradient(2, None) / 3, _row0_gradient(9, None))

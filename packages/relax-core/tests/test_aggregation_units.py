"""``aggregation_units``: the weights that combine the losses of a batch's parts into the whole batch's loss."""

from __future__ import annotations

import pytest
import torch

from relax_core import aggregate_loss, aggregation_units

MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("seed", range(5))
def test_unit_weighted_parts_give_the_whole_batch_loss(mode: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    loss = torch.randn(9, 7, generator=gen, dtype=torch.float64)
    mask = torch.rand(9, 7, generator=gen) < 0.5
    mask[2] = False  # a sequence with no kept token (masked IS rejected all of it)
    mask[5:7] = False  # and a part made only of such sequences below
    whole = aggregate_loss(loss, mask, mode, norm_constant=7.0)  # type: ignore[arg-type]
    parts = [slice(0, 3), slice(3, 5), slice(5, 7), slice(7, 9)]
    units = [aggregation_units(mask[p], mode) for p in parts]  # type: ignore[arg-type]
    combined = sum(
        u * aggregate_loss(loss[p], mask[p], mode, norm_constant=7.0)  # type: ignore[arg-type]
        for u, p in zip(units, parts, strict=True)
    ) / sum(units)
    torch.testing.assert_close(combined, whole)


def test_units_by_hand() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregation_units(mask, "token-mean") == 3.0
    assert aggregation_units(mask, "seq-mean-token-mean") == 2.0  # the empty row is left out
    assert aggregation_units(mask, "seq-mean-token-sum") == 2.0
    assert aggregation_units(mask, "seq-mean-token-sum-norm") == 3.0  # B · C counts every row
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'median'"):
        aggregation_units(mask, "median")  # type: ignore[arg-type]

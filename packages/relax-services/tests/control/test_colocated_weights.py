"""``run.reuse_weight_buffers`` reaches the colocated mode's weight store: a spare version's buffers are reused only
when asked (off by default: one copy of the weights less at the training step's peak)."""

from __future__ import annotations

import pytest
import torch

from relax_services.config import load_run_config
from relax_services.control.colocated import build_local_pipeline


@pytest.mark.parametrize("reuse", [False, True])
def test_the_colocated_store_reuses_buffers_only_when_asked(reuse: bool) -> None:
    cfg = load_run_config(None, ["run.mode=colocated", f"run.reuse_weight_buffers={reuse}"])
    weights = build_local_pipeline(cfg, []).weights
    for version in range(3):  # version 0 retires to the spare at 1; no reader holds it, so 2 may land in it
        weights.publish(version, {"w": torch.full((1024,), float(version))})
    assert weights.recycled == (1 if reuse else 0)
    update = weights.fetch(None)
    assert update is not None and torch.equal(update.state_dict["w"], torch.full((1024,), 2.0))

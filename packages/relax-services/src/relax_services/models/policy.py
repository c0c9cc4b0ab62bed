"""The policy model every role builds, from the run's checkpoint folder (the default one included)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relax_services.models.checkpoint import Checkpoint, open_checkpoint

if TYPE_CHECKING:
    from relax_services.config import ModelConfig

__all__ = ["build_policy", "checkpoint_of"]


def checkpoint_of(cfg: ModelConfig) -> Checkpoint:
    """The run's validated checkpoint folder (``"tiny-omni"``: the default one, written once from ``cfg.seed``)."""
    return open_checkpoint(cfg.source, cfg.seed)


def build_policy(cfg: ModelConfig) -> Any:
    """Same weights in every process for the same config: the checkpoint folder loaded by its family's class."""
    return checkpoint_of(cfg).load_model()

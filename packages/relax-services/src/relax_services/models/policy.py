"""The policy model every role builds, from the run's checkpoint folder (the default one included)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from relax_services.models.checkpoint import Checkpoint, open_checkpoint

if TYPE_CHECKING:
    import torch

    from relax_services.config import ModelConfig

__all__ = ["PolicyFactory", "build_policy", "checkpoint_of", "empty_policy"]


def checkpoint_of(cfg: ModelConfig) -> Checkpoint:
    """The run's validated checkpoint folder (``"tiny-omni"``: the default one, written once from ``cfg.seed``)."""
    return open_checkpoint(cfg.source, cfg.seed)


def build_policy(cfg: ModelConfig) -> Any:
    """Same weights in every process for the same config: the checkpoint folder loaded by its family's class."""
    return checkpoint_of(cfg).load_model()


def empty_policy(cfg: ModelConfig) -> torch.nn.Module:
    """The run's policy built on the meta device from its checkpoint's config: every parameter and buffer of the
    loaded model's shapes in float32, no weights read or allocated (a Trainer rank that receives its weights from
    rank 0, see :class:`~relax_services.engines.fsdp.train.FSDPTrainEngine`)."""
    import torch

    checkpoint = checkpoint_of(cfg)
    model: torch.nn.Module
    with torch.device("meta"):
        # transformers' own constructor from a config (what from_pretrained builds before it reads the weights), so
        # the attention implementation is the loaded model's
        model = checkpoint.family.load_class()._from_config(checkpoint.config).to(torch.float32)  # type: ignore[no-untyped-call]
    torch.nn.Module.eval(model)
    return model


class PolicyFactory:
    """Builds the run's policy in a process (picklable, sent to each Trainer rank): loaded from the checkpoint
    (``factory()``), or its empty shape on the meta device (``factory.empty()``) for the ranks that receive rank
    0's weights."""

    def __init__(self, cfg: ModelConfig) -> None:
        self.cfg = cfg

    def __call__(self) -> torch.nn.Module:
        model: torch.nn.Module = build_policy(self.cfg)
        return model

    def empty(self) -> torch.nn.Module:
        """:func:`empty_policy`."""
        return empty_policy(self.cfg)

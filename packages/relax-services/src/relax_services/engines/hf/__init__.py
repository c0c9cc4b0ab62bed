"""The transformers rollout engine (``rollout.engine=hf``): batched incremental decoding of the run's policy."""

from __future__ import annotations

from typing import TYPE_CHECKING

from relax_services.config.devices import device_of, dtype_of
from relax_services.config.threads import threads_of
from relax_services.engines.hf.rollout import HFRolloutConfig, HFRolloutEngine
from relax_services.models.policy import build_policy

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.engines.registry import RolloutEngineOptions

__all__ = ["HFRolloutConfig", "HFRolloutEngine", "build_hf_rollout_engine"]


def build_hf_rollout_engine(cfg: RunConfig, options: RolloutEngineOptions) -> HFRolloutEngine:
    """``rollout.engine=hf``: the transformers engine over the run's policy, on the device and in the dtype of
    ``options.role`` (rollout or eval)."""
    mode = options.partial_rollout if options.partial_rollout is not None else cfg.rollout.partial_rollout
    role = options.role
    config = HFRolloutConfig(
        partial_rollout=mode, device=device_of(cfg, role), dtype=dtype_of(cfg, role), intra_op_threads=threads_of(cfg)
    )
    return HFRolloutEngine(build_policy(cfg.model), config)

"""The KL coefficient's controller: fixed, or adaptive toward a target KL (Ziegler et al. 2019)."""

from __future__ import annotations

from dataclasses import dataclass

from relax_core.config.components import AlgorithmConfig

__all__ = ["KLController"]


@dataclass
class KLController:
    """The coefficient β of the KL term and its update after each policy update.

    Adaptive (Ziegler et al. 2019, "Fine-tuning language models from human preferences", §2.2):
    e = clip(KL / KL_target − 1, −0.2, 0.2), β ← β · (1 + e · n / horizon), with n the samples of the update,
    so β grows while the measured KL is above its target and shrinks while below. Fixed: β never changes.

    Attributes:
        value: The current β.
        adaptive: Whether :meth:`update` moves β.
        target: KL_target.
        horizon: The horizon (in samples) over which the error is corrected.
    """

    value: float
    adaptive: bool = False
    target: float = 0.1
    horizon: int = 10000

    @classmethod
    def from_config(cls, cfg: AlgorithmConfig) -> KLController:
        """The controller of ``cfg.kl_ctrl``, starting at ``cfg.kl_coef``."""
        ctrl = cfg.kl_ctrl
        return cls(cfg.kl_coef, ctrl.type == "adaptive", ctrl.target_kl, ctrl.horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Move β after an update whose measured KL was ``current_kl`` over ``n_steps`` samples; returns the new β."""
        if self.adaptive:
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_steps / self.horizon
        return self.value

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps: β (the settings come from the config)."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore β from :meth:`state_dict`."""
        self.value = float(state["value"])

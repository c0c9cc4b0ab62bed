"""Algorithm presets: plain YAML data shipped in ``relax_core/presets``, read on demand."""

from __future__ import annotations

from importlib import resources
from typing import Any, Literal, get_args

import yaml

__all__ = ["PRESET_NAMES", "PresetName", "preset_data"]

PresetName = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo"]
PRESET_NAMES: tuple[str, ...] = get_args(PresetName)


def preset_data(name: str) -> dict[str, Any]:
    """The raw field values of preset ``name`` (without the ``preset`` key itself).

    Raises:
        KeyError: If ``name`` is not one of :data:`PRESET_NAMES`.
    """
    if name not in PRESET_NAMES:
        raise KeyError(f"unknown preset {name!r}; allowed: {', '.join(PRESET_NAMES)}")
    text = resources.files("relax_core").joinpath("presets", f"{name}.yaml").read_text(encoding="utf-8")
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"preset {name!r} is not a mapping")
    return data

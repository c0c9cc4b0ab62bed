"""Algorithm presets: named hyper-parameter sets, read from the algorithm table (:data:`~relax_core.ALGORITHMS`)."""

from __future__ import annotations

from typing import Any

from relax_core.algorithms.table import ALGORITHMS, preset_names

__all__ = ["PRESET_NAMES", "PresetName", "preset_data"]

PresetName = str
"""A preset name: one of :func:`~relax_core.preset_names` (checked when a config is loaded)."""

PRESET_NAMES: tuple[str, ...] = preset_names()
"""The presets of the built-in table (entries added to the table later are found by :func:`preset_data`)."""


def preset_data(name: str) -> dict[str, Any]:
    """The field values of preset ``name`` (without the ``preset`` key itself), its estimator included.

    Raises:
        KeyError: If no entry of the algorithm table has a preset ``name``.
    """
    for estimator, spec in ALGORITHMS.items():
        if name in spec.presets:
            return {"advantage_estimator": estimator, **spec.presets[name]}
    raise KeyError(f"unknown preset {name!r}; allowed: {', '.join(preset_names())}")

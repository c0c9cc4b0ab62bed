"""The run config's ``metrics`` section: where a run's metric records go besides ``metrics.jsonl``.

Exported by :mod:`relax_services.config`. A sink whose package is not installed is an error at config load that
names the extra to install (the sinks themselves live in :mod:`relax_services.reporting.sinks`).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

import pydantic

from relax_core import ConfigModel

__all__ = ["SINK_PACKAGES", "MetricsConfig", "SinkName"]

SinkName = Literal["jsonl", "tensorboard", "wandb", "mlflow"]

SINK_PACKAGES: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""Sink → the module it imports; the extra that installs it is ``relax-services[<sink>]``."""


class MetricsConfig(ConfigModel):
    """Where metric records go. ``metrics.jsonl`` in the run folder is always written; the other sinks receive the
    same scalars (every numeric field of the ``train``, ``eval`` and ``rollout`` records at its step), the
    histograms of each update's sample staleness and rewards, and the run config."""

    sinks: list[SinkName] = pydantic.Field(default_factory=lambda: list[SinkName](["jsonl"]))
    """Any of ``jsonl`` (always on, listed or not), ``tensorboard`` (event files under ``<run>/tensorboard``),
    ``wandb`` (a W&B run under ``<run>/wandb``, offline unless ``metrics.wandb_mode=online``) and ``mlflow`` (an
    MLflow file store under ``<run>/mlruns``)."""

    project: str = pydantic.Field(default="relax", min_length=1)
    """The W&B project and the MLflow experiment the run is logged under."""

    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline``: the W&B run is written under the run folder only (``wandb sync <run>/wandb/offline-run-*``
    uploads it later); ``online``: it is also sent to the W&B server (needs a login and a network)."""

    @pydantic.field_validator("sinks")
    @classmethod
    def _installed(cls, sinks: list[str]) -> list[str]:
        for sink in sinks:
            module = SINK_PACKAGES.get(sink)
            if module is not None and importlib.util.find_spec(module) is None:
                raise ValueError(
                    f"sink {sink!r} needs the {module} package, which is not installed: install the extra "
                    f"relax-services[{sink}] (in this repository: uv sync --all-packages --extra {sink})"
                )
        return ["jsonl", *dict.fromkeys(s for s in sinks if s != "jsonl")]

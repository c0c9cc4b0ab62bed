"""The W&B sink: one W&B run per relax run, under ``<run>/wandb`` (offline unless ``metrics.wandb_mode=online``).

Records of different kinds speak of different versions and arrive out of order (a rollout record of version 3 after
a train record of step 5), while W&B's own step only grows; so each kind has its step metric (``train/step``,
``eval/version``, ``rollout/version``) declared with ``define_metric``, and every log carries it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from relax_services.config import MetricsConfig
from relax_services.reporting.sinks import STEP_FIELDS, Digest

__all__ = ["WandbSink"]


class WandbSink:
    """Logs each digest as one W&B history row; the run config is the W&B run's config."""

    def __init__(self, run_dir: Path, config: Mapping[str, object], config_text: str, settings: MetricsConfig) -> None:
        import wandb

        self._wandb = wandb
        self.run = wandb.init(
            mode=settings.wandb_mode,
            dir=str(run_dir),
            project=settings.project,
            name=run_dir.name,
            config=dict(config),
            settings=wandb.Settings(silent=True, console="off", x_disable_stats=True, save_code=False),
        )
        for kind, field in STEP_FIELDS.items():
            self.run.define_metric(f"{kind}/{field}")
            self.run.define_metric(f"{kind}/*", step_metric=f"{kind}/{field}")

    def write(self, item: Digest) -> None:
        """Log the digest's scalars and histograms with its kind's step metric."""
        import numpy as np

        row: dict[str, object] = dict(item.scalars)
        row[f"{item.kind}/{STEP_FIELDS[item.kind]}"] = item.step
        for tag, h in item.histograms.items():
            row[tag] = self._wandb.Histogram(np_histogram=(np.asarray(h.counts), np.asarray(h.edges)))
        self.run.log(row)

    def close(self) -> None:
        """Finish the W&B run and stop W&B's background process: ``finish`` returns before that process has written
        the run's last records to its ``.wandb`` file; the teardown waits for it."""
        self.run.finish()
        self._wandb.teardown()

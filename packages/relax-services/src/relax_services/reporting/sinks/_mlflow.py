"""The MLflow sink: one MLflow run in a file store under ``<run>/mlruns`` (``mlflow ui --backend-store-uri
<run>/mlruns`` shows it). MLflow has no histogram type: each histogram is a JSON artifact,
``histograms/<tag>/step_<step>.json`` holding its ``edges`` and ``counts``.

MLflow 3 keeps its file store in maintenance mode and refuses it unless ``MLFLOW_ALLOW_FILE_STORE`` is set; the sink
sets it (when unset) for this process, since a file store under the run folder is what needs no server.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from pathlib import Path

from relax_services.config import MetricsConfig
from relax_services.reporting.sinks import Digest

__all__ = ["MlflowSink"]

_NAME = re.compile(r"[^\w\-. /]")  # what MLflow allows in a metric name
_BATCH = 100  # MLflow's limit of params per log_batch call (metrics: 1000)


def flat_params(data: Mapping[str, object], prefix: str = "") -> dict[str, str]:
    """The run config as MLflow params: dotted keys (``trainer.lr``) → the value's text."""
    out: dict[str, str] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = str(value)[:6000]  # MLflow's limit of a param value's length
    return out


class MlflowSink:
    """Logs scalars as MLflow metrics at their step, histograms as JSON artifacts, the config as params plus
    ``config.yaml``."""

    def __init__(self, run_dir: Path, config: Mapping[str, object], config_text: str, settings: MetricsConfig) -> None:
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = MlflowClient(tracking_uri=self.uri)
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self.client.create_experiment(settings.project)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=run_dir.name).info.run_id
        params = [Param(k, v) for k, v in flat_params(config).items()]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + _BATCH])
        self.client.log_text(self.run_id, config_text, "config.yaml")

    def write(self, item: Digest) -> None:
        """Log the digest's scalars as metrics and each histogram as an artifact."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_NAME.sub("_", tag), value, now, item.step) for tag, value in item.scalars.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)
        for tag, h in item.histograms.items():
            body = {"step": item.step, "edges": h.edges, "counts": h.counts}
            self.client.log_dict(self.run_id, body, f"histograms/{tag}/step_{item.step:06d}.json")

    def close(self) -> None:
        """Mark the MLflow run finished."""
        self.client.set_terminated(self.run_id)

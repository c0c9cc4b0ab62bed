"""Read a run's sinks back with each library's own reader (TensorBoard's EventAccumulator, MLflow's MlflowClient,
W&B's record protobuf over the offline ``.wandb`` file), for the tests beside this module."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

_BLOCK = 32768  # the .wandb file is a LevelDB-format log: 32 KiB blocks of records with 7-byte headers
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_run(run_dir: Path) -> Any:
    """TensorBoard's EventAccumulator over ``<run>/tensorboard``, every event kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "histograms": 0, "tensors": 0})
    acc.Reload()
    return acc


def mlflow_run(run_dir: Path) -> tuple[Any, str]:
    """An MlflowClient over ``<run>/mlruns`` and the id of its one run."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("relax")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    return client, run.info.run_id


def wandb_records(run_dir: Path) -> list[Any]:
    """The records of the offline W&B run under ``<run>/wandb``, parsed with W&B's own ``Record`` protobuf.

    wandb 0.31 has no Python reader of its transaction log (its Go core writes and reads it), so the log's framing
    (LevelDB's: a 7-byte file header, then per record a CRC-32C, a little-endian length and a chunk type) is undone
    here; every record's content is decoded by W&B's protobuf.
    """
    from wandb.proto.wandb_internal_pb2 import Record

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    records, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:  # zero padding at the end
            break
        pending = chunk if kind in (_FULL, _FIRST) else pending + chunk
        if kind in (_FULL, _LAST):
            record = Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def wandb_history(run_dir: Path) -> list[dict[str, Any]]:
    """The offline W&B run's history rows (key → value decoded from its JSON)."""
    rows = []
    for record in wandb_records(run_dir):
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            )
    return rows


def wandb_config(run_dir: Path) -> dict[str, Any]:
    """The offline W&B run's config (top-level key → value): the run record's, then any later config updates."""
    config: dict[str, Any] = {}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        updates = record.run.config.update if kind == "run" else record.config.update if kind == "config" else []
        for item in updates:
            config[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return config

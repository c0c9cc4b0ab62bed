"""Run-folder bookkeeping: metrics as strict JSON lines, fanned out to the run's other sinks, read back for plots
and summaries.

Every line of ``metrics.jsonl`` is one strict JSON object (RFC 8259: no ``NaN`` or ``Infinity``, which JSON has no
words for). A value that is not a finite number is written as ``null`` and its dotted path is listed in the record's
``nonfinite`` field (``"nonfinite": ["chance.text"]``: ``chance.text`` was NaN); a record without that field had no
such value. Every record has ``kind`` and ``wall`` (seconds on the run's clock); records from a service also have
``service`` (its name) and ``time`` (Unix seconds).

The record kinds and their fields (the services' own fields first, then what the controller adds):

=================  =================================================================================================
kind               fields
=================  =================================================================================================
``train``          one update: ``step`` (the version it produced), ``samples``, ``reward`` (mean), ``rewards`` (each
                   sample's), ``reward_by_task`` (task → mean), ``staleness_hist`` and ``token_staleness_hist``
                   (staleness → samples), ``max_staleness``, ``samples_by_replica`` (the Rollout replica that
                   generated them → samples), ``stale_flagged``, ``reward_failures``,
                   ``filtered_rows``, ``env_token_frac``, ``kl_coef``, ``wait_s``, ``train_s``, ``weight_sync_s``,
                   ``weight_sync_bytes``, ``weight_sync_memcpy_s``, ``queue_s``, and the engine's losses (``loss``,
                   ``pg_loss``, ``kl``, ``entropy``, ``grad_norm``, ``lr``, ``critic_*`` ...)
``filtered``       a batch of uniformly scored groups consumed without an update: ``rows``
``eval``           held-out reward of one weights version: ``version``, ``reward`` (task → mean), ``chance``
                   (task → chance level, NaN when unknown), ``final`` (true: the run's final weights)
``rollout``        one Rollout call: ``prompts``, ``samples``, ``tokens``, ``seconds``, ``blocked_s`` (seconds
                   since the previous call with no admitted prompt to take or a put blocked on a full queue),
                   ``version``,
                   ``weight_sync_s``, ``weight_load_s``, ``weight_paths``, multi-turn counters (``turns_mean``,
                   ``tool_calls``, ``tool_errors``, ``tool_timeouts``, ``env_failures``, ``env_token_frac``)
``reward``         one Reward call: ``scored``, ``env_scored``, ``failed``, ``timeouts``, ``last_error``
``reference``      one Reference call: ``scored``
``critic``         one Critic call: ``scored``, ``version``
``skipped``        a prompt row not generated: ``prompt_key``, ``reason``
``late_ack``       rows acknowledged after their lease ran out: ``rows``
``device_memory``  a service's GPU peak: ``peak_mib``, ``reserved_mib``
``plan``           the Trainer's realised parallelism plan: ``text``
``error``          a service's work loop raised: ``error``, ``traceback``
``queue``          the sample queue at a progress report: ``depth_rows``, ``depth_bytes``, ``version``,
                   ``admission``, ``drops``, ``requeues``, ``redeliveries``
``health``         a health event: ``event`` (``detected``, ``restarted``, ``injected``, ``global_restart``,
                   ``recovered``, ``restored``, ``gave_up`` ...), ``service``, ``time``, and the event's details
``scale``          a step of a replica scaling operation (``relax scale``, ``rollout.autoscale``): ``event``
                   (``requested``, ``join_started``, ``joined``, ``join_failed``, ``drain_started``, ``removed``,
                   ``done``, ``failed``, ``autoscale_failed``), ``role``, and the step's ``replica``, ``seconds`` ...
``checkpoint``     a checkpoint written: ``step``, ``path``, ``data`` (dataset report, with dataset files)
``resume``         a ``--resume``: ``from`` (the checkpoint folder), ``changes`` (key → [saved, new])
``warmup``         the format warm-up: its steps, losses and whether it came from the cache
``summary``        the run's end: ``final_eval`` (task → reward), ``ledger``, ``stop_reason``, ``error`` (when it
                   ended with one), ``skipped_media``, ``data``
=================  =================================================================================================
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_services.reporting.sinks import SinkFanout

__all__ = ["MetricsWriter", "read_metrics", "strict_record"]


class MetricsWriter:
    """Appends one strict JSON object per line to ``metrics.jsonl``; each line is flushed at once.

    Every record carries ``kind`` (e.g. ``"train"``, ``"eval"``, ``"queue"``) and ``wall`` (seconds since the
    writer was created), so plots against wall-clock time need no other clock. With ``sinks`` attached, each
    record also goes to them (TensorBoard, W&B, MLflow), after its line is written.
    """

    def __init__(self, path: Path, start_time: float | None = None) -> None:
        self.path = path
        self.start = time.monotonic() if start_time is None else start_time
        self.sinks: SinkFanout | None = None
        self._lock = threading.Lock()  # the controller's loop and the health manager write from their threads
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, kind: str, record: Mapping[str, object]) -> dict[str, object]:
        """Write ``record`` tagged with ``kind`` and the wall time; return what was written."""
        row = strict_record({"kind": kind, "wall": round(time.monotonic() - self.start, 4), **record})
        with self._lock:
            self._file.write(json.dumps(row, allow_nan=False) + "\n")
            self._file.flush()
            if self.sinks is not None:
                self.sinks.write(kind, row)
        return row

    def close(self) -> None:
        """Flush and close the metrics file, then the sinks."""
        with self._lock:
            self._file.close()
            if self.sinks is not None:
                self.sinks.close()


def strict_record(record: Mapping[str, object]) -> dict[str, object]:
    """``record`` as plain JSON data (numpy and torch scalars and arrays to numbers and lists, paths to text) with
    every non-finite float replaced by ``None`` and listed by dotted path under ``nonfinite``.

    Raises:
        TypeError: a value that has no JSON form.
    """
    nonfinite: list[str] = []
    row = {str(k): _plain(v, str(k), nonfinite) for k, v in record.items() if k != "nonfinite"}
    if nonfinite:
        row["nonfinite"] = nonfinite
    return row


def _plain(value: object, path: str, nonfinite: list[str]) -> object:
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        nonfinite.append(path)
        return None
    if isinstance(value, Mapping):
        return {str(k): _plain(v, f"{path}.{k}", nonfinite) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v, f"{path}.{i}", nonfinite) for i, v in enumerate(value)]
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):  # numpy / torch scalars and arrays
        return _plain(value.tolist(), path, nonfinite)
    if hasattr(value, "item"):
        return _plain(value.item(), path, nonfinite)
    raise TypeError(f"metrics value {path} of type {type(value).__name__} is not JSON serialisable")


def read_metrics(path: Path, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """Yield the records of ``metrics.jsonl`` (optionally only those of one ``kind``); a torn last line is skipped.

    Values written as ``null`` for a non-finite number (listed in the record's ``nonfinite``) come back as NaN, so
    readers that compute with them see what was measured.
    """
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if kind is None or row.get("kind") == kind:
                _restore_nonfinite(row)
                yield row


def _restore_nonfinite(row: dict[str, object]) -> None:
    """Put NaN back where ``row``'s ``nonfinite`` list says a non-finite number was written as null."""
    flagged = row.get("nonfinite")
    for dotted in flagged if isinstance(flagged, list) else ():
        *parents, last = dotted.split(".")
        node: Any = row
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.get(part)
            if node is None:
                break
        else:
            if isinstance(node, list):
                node[int(last)] = math.nan
            elif isinstance(node, dict) and last in node:
                node[last] = math.nan

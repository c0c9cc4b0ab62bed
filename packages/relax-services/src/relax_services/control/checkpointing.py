"""The controller's checkpoints: when one is due (by updates, and by time since the last one), and how one is
written consistently — the trainer held at a step boundary, the feeder held, then the engine state, both queue
snapshots and the feeder's position with its ledger, renamed into place together (a failed write leaves no partial
folder, and the previous checkpoint stays the latest)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_services.config import RunConfig
from relax_services.control.checkpoint import (
    CONTROLLER_FILE,
    ENGINE_FILE,
    PROMPTS_FILE,
    SAMPLES_FILE,
    CheckpointManager,
    write_controller_state,
)
from relax_services.control.run_result import CheckpointWriteError
from relax_services.data.feeder import PromptFeeder
from relax_services.data.run_data import RunData, data_report
from relax_services.faults.health import GlobalRestartNeeded
from relax_services.reporting.metrics import MetricsWriter

__all__ = ["Checkpointing"]


class Checkpointing:
    """Checkpoints for :class:`~relax_services.control.controller.Controller`, which sets these attributes and calls
    :meth:`_checkpoint_due` and :meth:`_checkpoint` from its loop; the colocated controller overrides
    :meth:`_checkpoint` only (direct calls to the trainer thread instead of Ray calls)."""

    cfg: RunConfig
    step: int
    pipeline: Any  # the distributed or the colocated pipeline: services by key, the prompt and sample queues
    feeder: PromptFeeder
    checkpoints: CheckpointManager
    metrics: MetricsWriter
    data: RunData
    _checkpoint_step: int  # the version of the last checkpoint written
    _checkpoint_time: float  # when it was written (time.monotonic)
    _poll_services: Callable[[], None]  # the controller's: ingest every record the services reported
    _service_call: Callable[..., object]  # the controller's: one call to a service, waited for
    clock: Callable[[], float]  # the controller's: seconds of this run so far on its one clock

    def _checkpoint(self, hold: bool = False) -> Path:
        """A consistent checkpoint: trainer held between updates, feeder held, then engine state, prompt queue,
        sample queue (in that order: a prompt acked meanwhile has its samples in the later snapshot) and the
        feeder position with its ledger, renamed into place together. ``hold`` leaves the trainer held after it
        (the end of the run).

        Raises:
            CheckpointWriteError: the files could not be written (the partial folder is removed; the previous
                checkpoint stays the latest).
        """
        import ray

        trainer = self.pipeline.services["trainer"].handle
        try:
            # A healthy trainer reaches a step boundary within seconds; a hung one is restarted instead.
            version = int(ray.get(trainer.pause.remote(), timeout=30 + 2 * self.cfg.health.heartbeat_timeout_s))
        except ray.exceptions.RayError as exc:
            raise GlobalRestartNeeded(f"trainer unavailable for a checkpoint: {type(exc).__name__}") from exc

        def save_engine(path: str) -> None:
            try:
                ray.get(trainer.save_engine.remote(path), timeout=600)
            except ray.exceptions.RayTaskError as exc:
                if isinstance(exc.cause, OSError):  # the trainer could not write: the same as a write here
                    raise exc.cause from None
                raise GlobalRestartNeeded(f"trainer failed while checkpointing: {type(exc).__name__}") from exc
            except ray.exceptions.RayError as exc:
                raise GlobalRestartNeeded(f"trainer failed while checkpointing: {type(exc).__name__}") from exc

        return self._write_checkpoint(version, save_engine, None if hold else lambda: trainer.resume.remote())

    def _write_checkpoint(
        self, version: int, save_engine: Callable[[str], None], resume_trainer: Callable[[], object] | None
    ) -> Path:
        """The checkpoint of a held trainer at ``version``: feeder held, then engine state (``save_engine``),
        prompt queue, sample queue and the feeder position with its ledger, renamed into place together; then the
        trainer resumes (``resume_trainer``; None leaves it held) and the HF export is written.

        Raises:
            CheckpointWriteError: the files could not be written (the partial folder is removed; the previous
                checkpoint stays the latest).
        """
        self.feeder.pause()
        try:
            self._poll_services()  # the ledger must include every update up to this version
            tmp: Path | None = None
            try:
                tmp = self.checkpoints.begin(version)
                save_engine(str(tmp / ENGINE_FILE))
                self.pipeline.prompt_queue.save(str(tmp / PROMPTS_FILE))
                self.pipeline.sample_queue.save(str(tmp / SAMPLES_FILE))
                self._poll_services()  # rows a Rollout worker skipped (reported, then acked) before the snapshots
                state = {"step": version, "feeder": self.feeder.state_dict(), "elapsed_s": self.clock()}
                write_controller_state(tmp / CONTROLLER_FILE, state)
                data = data_report(self.data)  # while the feeder is held: its bad-row counts do not move
                path = self.checkpoints.commit(version, tmp)
            except OSError as exc:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise CheckpointWriteError(self.checkpoints.folder, version, self.checkpoints.latest(), exc) from exc
            except BaseException:  # e.g. a queue actor died during its snapshot: no partial folder stays
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            self.feeder.resume()
            if resume_trainer is not None:
                resume_trainer()
        self._checkpoint_step = version
        if self.cfg.model.export_hf:  # after the trainer resumed: a derived copy, `relax export` can redo it
            self._service_call("trainer", "export_hf", str(path))  # by the process with the model stack
        self._checkpoint_time = time.monotonic()
        self.metrics.write(
            "checkpoint", {"step": version, "path": str(path), **({} if data is None else {"data": data})}
        )
        return path

    def _checkpoint_due(self) -> bool:
        """Every ``trainer.checkpoint_every`` updates, and every ``trainer.checkpoint_every_s`` seconds with at
        least one new update: a failure then costs at most that much work either way."""
        cfg = self.cfg.trainer
        if self.step >= self._checkpoint_step + cfg.checkpoint_every:
            return True
        every_s = cfg.checkpoint_every_s
        return (
            every_s is not None
            and self.step > self._checkpoint_step
            and (time.monotonic() - self._checkpoint_time >= every_s)
        )

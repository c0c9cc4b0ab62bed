"""Crash-consistent run checkpoints.

A checkpoint is a folder ``step_XXXXXXXX/`` holding the trainer's engine state (model, optimizer, RNG, version),
snapshots of both queues (rows, leases, versions; leased work is redelivered on restore) and the controller's
state (prompt feeder position, ledger). Everything is written into a temporary folder first and renamed into
place in one step, so a crash mid-write leaves the previous checkpoint intact; only the newest ``keep`` are kept.

The controller reads and writes its own files without torch: its state is a plain pickle
(:func:`write_controller_state`), and a checkpoint's engine file (a ``torch.save`` zip archive written by the
trainer) is checked by the archive's checksums rather than loaded, so finding the latest checkpoint never brings
a model and optimizer state into the controller's memory.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from relax_services._files import ENGINE_FILE, fsync_path

__all__ = [
    "CONTROLLER_FILE",
    "ENGINE_FILE",
    "PROMPTS_FILE",
    "SAMPLES_FILE",
    "CheckpointManager",
    "fsync_path",
    "load_queue_snapshots",
    "queued_prompt_keys",
    "write_controller_state",
]

if TYPE_CHECKING:
    from relax_queue import QueueClient

CONTROLLER_FILE = "controller.pt"
PROMPTS_FILE = "prompts.queue"
SAMPLES_FILE = "samples.queue"
_REQUIRED = (ENGINE_FILE, CONTROLLER_FILE, PROMPTS_FILE, SAMPLES_FILE)
_NAME = re.compile(r"^step_(\d{8})$")
_ZIP_MAGIC = b"PK\x03\x04"  # how a torch.save file (a zip archive) begins


def write_controller_state(path: Path, state: Mapping[str, object]) -> None:
    """Write the controller's state (feeder position, ledger, step, time) to ``path`` as a plain pickle."""
    with open(path, "wb") as f:
        pickle.dump(dict(state), f, protocol=pickle.HIGHEST_PROTOCOL)
        f.flush()
        os.fsync(f.fileno())


def _check_archive(path: Path) -> None:
    """Raise unless ``path`` is a complete zip archive whose every member matches its checksum (what a
    ``torch.save`` file is); reads the file, allocates none of its tensors."""
    with zipfile.ZipFile(path) as archive:
        bad = archive.testzip()
    if bad is not None:
        raise zipfile.BadZipFile(f"{path}: member {bad} fails its checksum")


class CheckpointManager:
    """Writes, lists and loads the checkpoints of one run folder."""

    def __init__(self, folder: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.keep = keep

    def path(self, step: int) -> Path:
        """The folder of the checkpoint after ``step`` updates (``step_<8 digits>``; it may not exist)."""
        return self.folder / f"step_{step:08d}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present (all files there), oldest first."""
        if not self.folder.is_dir():
            return []
        found = []
        for p in self.folder.iterdir():
            m = _NAME.match(p.name)
            if m and p.is_dir() and all((p / f).is_file() for f in _REQUIRED):
                found.append(int(m.group(1)))
        return sorted(found)

    def begin(self, step: int) -> Path:
        """A fresh temporary folder to write the checkpoint of ``step`` into (then :meth:`commit` it)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.folder / f".tmp-step_{step:08d}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        return tmp

    def commit(self, step: int, tmp: Path) -> Path:
        """Flush ``tmp``'s files, rename it into place as the checkpoint of ``step``, prune old ones."""
        missing = [f for f in _REQUIRED if not (tmp / f).is_file()]
        if missing:
            raise RuntimeError(f"checkpoint of step {step} is incomplete: missing {missing}")
        for f in tmp.iterdir():
            with f.open("rb") as fh:
                os.fsync(fh.fileno())
        fsync_path(tmp)
        final = self.path(step)
        if final.exists():  # re-checkpointing the same step (e.g. at shutdown): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        fsync_path(self.folder)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.path(old), ignore_errors=True)
        return final

    def latest(self) -> Path | None:
        """The newest complete checkpoint whose files are intact (the engine archive's checksums hold, the controller
        state loads); a damaged one (e.g. truncated) is skipped."""
        for step in reversed(self.steps()):
            path = self.path(step)
            try:
                _check_archive(path / ENGINE_FILE)
                self.load_controller(path)
            except Exception:  # unreadable: fall back to the previous checkpoint
                continue
            return path
        return None

    @staticmethod
    def load_engine(path: Path) -> dict[str, Any]:
        """The trainer engine state of checkpoint folder ``path``."""
        import torch

        state: dict[str, Any] = torch.load(path / ENGINE_FILE, map_location="cpu", weights_only=False)
        return state

    @staticmethod
    def load_controller(path: Path) -> dict[str, Any]:
        """The controller's state saved in checkpoint folder ``path``: ``step``, ``feeder`` (its state dict) and
        ``elapsed_s`` (:func:`write_controller_state`; a file written by ``torch.save``, as checkpoints of earlier
        versions hold, is read with torch)."""
        file = path / CONTROLLER_FILE
        with open(file, "rb") as f:
            if f.read(4) != _ZIP_MAGIC:
                f.seek(0)
                state: dict[str, Any] = pickle.load(f)
                return state
        import torch

        state = torch.load(file, map_location="cpu", weights_only=False)
        return state


def queued_prompt_keys(path: Path) -> set[str]:
    """Prompt keys still held by the queue snapshots of checkpoint ``path``: prompt rows waiting for a Rollout
    worker, and groups of samples (keyed ``<prompt key>/<i>``) not yet consumed by the trainer."""
    from relax_queue import snapshot_keys
    from relax_services.rows import prompt_key_of

    return {prompt_key_of(key) for name in (PROMPTS_FILE, SAMPLES_FILE) for key in snapshot_keys(path / name)}


def load_queue_snapshots(prompt_queue: QueueClient, sample_queue: QueueClient, path: Path) -> None:
    """Restore both queues from checkpoint ``path`` (leased-but-unacked rows of the snapshots are delivered again).

    The Trainer reads every sample row's ``loss_mask`` (``rows.RolloutFields``); a snapshot written before the
    Rollout wrote that field holds rows without it, which the Trainer's reader would never deliver. They get an
    empty mask, which means every response token is the policy's, as it was then; a row that has one keeps it.
    """
    from relax_queue import snapshot_keys

    prompt_queue.load(str(path / PROMPTS_FILE), reset_running=False)
    sample_queue.load(str(path / SAMPLES_FILE), reset_running=False)
    keys = snapshot_keys(path / SAMPLES_FILE)
    if keys:  # a field a row has is left as it is
        sample_queue.add_fields_many({key: {"loss_mask": []} for key in keys})

"""Crash-consistent checkpoints: each is written to a temporary file, flushed to disk, then renamed into place,
so a crash mid-write leaves the previous checkpoint intact; only the newest ``keep`` are kept."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointManager"]

_NAME = re.compile(r"^step_(\d{8})\.pt$")


class CheckpointManager:
    """Saves and finds checkpoints ``step_XXXXXXXX.pt`` in one folder."""

    def __init__(self, folder: Path, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.keep = keep

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints present, oldest first."""
        if not self.folder.is_dir():
            return []
        found = (_NAME.match(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in found if m)

    def path(self, step: int) -> Path:
        return self.folder / f"step_{step:08d}.pt"

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write ``state`` as the checkpoint of ``step`` atomically; prune old ones; return its path."""
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self.path(step)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        dir_fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        for old in self.steps()[: -self.keep]:
            self.path(old).unlink(missing_ok=True)
        return final

    def load_latest(self) -> dict[str, Any] | None:
        """The newest checkpoint that loads; an unreadable one (e.g. truncated by a crash) is skipped."""
        for step in reversed(self.steps()):
            try:
                state: dict[str, Any] = torch.load(self.path(step), map_location="cpu", weights_only=False)
            except Exception:  # a damaged file: fall back to the previous checkpoint
                continue
            state.setdefault("step", step)
            return state
        return None

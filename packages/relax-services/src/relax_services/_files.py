"""Files of a run checkpoint that more than one layer touches: the engine state's file name (the controller's
checkpoint writes it through the Trainer, which reads it back for the Hugging Face export) and the flush of a file
or folder to disk (run checkpoints and the FSDP2 engine's sharded checkpoints). Standard library only."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ENGINE_FILE", "fsync_path"]

ENGINE_FILE = "engine.pt"
"""The trainer engine's state (model, optimizer, scheduler, RNG, version) inside a run checkpoint folder."""


def fsync_path(path: Path) -> None:
    """Flushes a file or a folder (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""What the driver needs of the models package without the model stack: the checkpoint errors and the cache folder.

The driver (the ``relax train`` process) validates ``model.source`` in a child process (see
:mod:`relax_services.models.source_check`) and raises these errors itself, so it never imports torch or transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["CheckpointError", "CheckpointNotFoundError", "cache_dir"]


class CheckpointError(ValueError):
    """A checkpoint folder is incomplete or inconsistent; the message names the path and the problem."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The folder, or its ``config.json``, does not exist."""


def cache_dir() -> Path:
    """Where the default checkpoint is written: ``$RELAX_CACHE_DIR``, else ``~/.cache/relax``."""
    root = os.environ.get("RELAX_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "relax"

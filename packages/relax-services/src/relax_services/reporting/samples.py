"""The run's samples files: each evaluation's conversations as ``<run>/samples/eval_step_<version>.jsonl``.

One strict JSON object per line (:func:`~relax_services.reporting.metrics.strict_record`): ``task``, ``prompt``,
``response``, ``reward`` (None when not finite, listed in ``nonfinite``), ``version`` (the evaluated weights'),
``step`` (the trainer's version when the controller wrote the file), ``staleness`` (``step - version``), ``final``
(the run's final evaluation) and ``media``: per input ``kind``, ``path`` (relative to the run folder when the file
was copied into ``samples/media``, else the original path), ``copied`` and, for an image, ``thumbnail`` (a PNG data
URI). At most ``eval.samples_per_task`` lines per task; media files are stored once by content.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import cast

from relax_services.reporting.metrics import strict_record

__all__ = ["MAX_MEDIA_BYTES", "SAMPLES_DIR", "read_samples", "write_eval_samples"]

SAMPLES_DIR = "samples"
MAX_MEDIA_BYTES = 32 * 2**20
"""A media file larger than this is linked at its original path instead of copied into the run folder."""


def write_eval_samples(
    run_dir: Path, version: int, step: int, samples: Sequence[Mapping[str, object]], *, final: bool = False
) -> Path:
    """Writes one evaluation's conversations (the Evaluator's ``samples``) and returns the file.

    Args:
        run_dir: The run folder.
        version: The evaluated weights' version (names the file).
        step: The trainer's version when the evaluation arrived (``staleness = step - version``).
        samples: ``{task, prompt, response, reward, media: [{kind, path, thumbnail}]}`` per conversation.
        final: Whether it is the run's final evaluation.
    """
    folder = run_dir / SAMPLES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for sample in samples:
        media = [_keep_media(run_dir, dict(m)) for m in cast("list[Mapping[str, object]]", sample.get("media", []))]
        row = {**sample, "media": media, "version": version, "step": step, "staleness": max(0, step - version)}
        lines.append(json.dumps(strict_record({**row, "final": final}), allow_nan=False))
    path = folder / f"eval_step_{version}.jsonl"
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def _keep_media(run_dir: Path, media: dict[str, object]) -> dict[str, object]:
    """A non-image file (an image has its thumbnail) is copied into ``samples/media`` under its content's digest,
    once, and linked relative to the run folder."""
    source = Path(str(media["path"]))
    media["copied"] = False
    if media.get("thumbnail") or not source.is_file() or source.stat().st_size > MAX_MEDIA_BYTES:
        return media
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:20]
    target = run_dir / SAMPLES_DIR / "media" / f"{digest}{source.suffix.lower()}"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target.with_suffix(target.suffix + ".tmp"))
        os.replace(target.with_suffix(target.suffix + ".tmp"), target)
    media.update(path=target.relative_to(run_dir).as_posix(), copied=True)
    return media


def read_samples(run_dir: Path) -> Iterator[dict[str, object]]:
    """Every sample of the run's samples files, by evaluated version."""
    files = sorted((run_dir / SAMPLES_DIR).glob("eval_step_*.jsonl"), key=lambda p: int(p.stem.rpartition("_")[2]))
    for path in files:
        with path.open(encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)

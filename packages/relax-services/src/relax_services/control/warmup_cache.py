"""A cache of format warm-ups (:mod:`relax_services.control.warmup`) under the model cache
(``$RELAX_CACHE_DIR/warmup``).

The warm-up is deterministic given what it reads, so its result is stored once, keyed by a digest of all of it:

- the model checkpoint folder's files (their bytes; see :func:`folder_digest` for very large files);
- every field of the config sections the warm-up reads (``model``, ``optimizer``, ``algorithm``, ``trainer``,
  ``rollout``), except the fields listed in :data:`UNREAD_FIELDS` with the reason each cannot change the result
  (a field added to those sections later is in the key until someone lists it there);
- the training items in order, each media file by its bytes (not its path: every run writes its synthetic tasks
  into its own folder);
- the code that runs it: the source files of relax-core, relax-modalities and relax-services, the versions of the
  libraries whose numerics it depends on, the Python version and the machine type.

An entry is a complete checkpoint folder plus ``warmup.json`` (the warm-up's metrics record) and ``inputs.json``
(what the key digests, to read when a miss is unexpected). Entries are written into a private folder and renamed
into place, so a reader sees a whole entry or none; of two runs storing one key at once, the first rename wins.

The cache keeps the :data:`KEEP_ENTRIES` most recently used entries: a hit touches its entry, and each store prunes
the rest (renamed aside, then deleted, so a reader again sees a whole entry or none; a run whose entry is pruned
while it copies it runs the warm-up instead). This module imports neither torch nor transformers.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.data.prompts import PromptBuilder
    from relax_services.data.run_data import WarmupItem

__all__ = [
    "INFO_FILE",
    "KEEP_ENTRIES",
    "UNREAD_FIELDS",
    "cached_warmup",
    "folder_digest",
    "format_warmup_task",
    "load_or_run",
    "prune_warmups",
    "restore_warmup",
    "store_warmup",
    "warmup_inputs",
    "warmup_key",
]

_FORMAT = 1  # bump when the entry layout or the meaning of a key changes
INFO_FILE = "warmup.json"
_INPUTS_FILE = "inputs.json"
_REQUIRED = ("config.json", INFO_FILE)

KEEP_ENTRIES = 8
"""Entries the cache keeps (the most recently used). Every change to the relax sources is a new key, so without a
bound the folder grows by one entry (~2 MB for the default model) per edit; 8 covers a few configs or branches in
use at once while bounding the default model's cache at ~16 MB."""

_STALE_PRIVATE_S = 24 * 3600.0  # a private folder older than this is what a killed store or prune left behind

SECTIONS = ("model", "optimizer", "algorithm", "trainer", "rollout")
"""Config sections the warm-up reads (``format_warmup`` and the train engine it builds); the rest (``data``,
``staleness``, ``reward``, ``queue``, ``eval``, ``health``, ``faults``, ``run``) it never reads: the data enter the
key as the items themselves."""

UNREAD_FIELDS: dict[str, dict[str, str]] = {
    "model": {
        "source": "the checkpoint folder enters as its files' digest, not its path",
        "export_hf": "read by the trainer's checkpoints only",
        "lora": "replaced by None: the warm-up trains every weight",
    },
    "optimizer": {
        "lr": "replaced by trainer.warmup_lr",
        "warmup_steps": "replaced by 0",
        "schedule": "replaced by the constant schedule",
        "total_steps": "read by the decaying schedules only",
        "min_lr_ratio": "read by the decaying schedules only",
    },
    "algorithm": {
        "kl_coef": "replaced by 0: the warm-up's loss has no KL term",
        "kl_estimator": "read with a KL term only",
    },
    "trainer": {
        "engine": "the warm-up always trains with the single-process torch engine",
        "groups_per_step": "batches are trainer.micro_batch_groups groups",
        "minibatches": "replaced by 1",
        "ppo_epochs": "replaced by 1",
        "total_steps": "read by the decaying schedules only",
        "max_minutes": "bounds the RL run",
        "target_reward": "bounds the RL run",
        "checkpoint_every": "RL checkpoints",
        "checkpoint_every_s": "RL checkpoints",
        "keep_checkpoints": "RL checkpoints",
    },
    "rollout": {
        "replicas": "rollout services",
        "groups_per_call": "rollout services",
        "top_p": "rollout sampling",
        "max_new_tokens": "rollout sampling",
        "engine": "rollout services",
        "partial_rollout": "rollout services",
    },
}
"""Per section, the fields left out of the key and why each cannot change the warm-up's result."""

_CODE_PACKAGES = ("relax_core", "relax_modalities", "relax_services")
_LIBRARIES = ("torch", "transformers", "tokenizers", "safetensors", "numpy", "pillow", "soundfile", "decord")
_CONTENT_LIMIT = 256 * 2**20  # files above this enter a digest by size and modification time (see folder_digest)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def folder_digest(folder: Path) -> str:
    """Digest of a folder's files (names relative to it, and contents), in name order.

    A file above 256 MiB (a large user checkpoint's weight shards) enters by size and modification time instead of
    its bytes, so that a run does not read gigabytes to compute a key: rewriting such a file changes its time, and
    copying a folder elsewhere only costs a miss.
    """
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        stat = path.stat()
        if stat.st_size > _CONTENT_LIMIT:
            part = f"size={stat.st_size} mtime_ns={stat.st_mtime_ns}"
        else:
            part = _sha256_file(path)
        digest.update(f"{path.relative_to(folder).as_posix()}\0{part}\n".encode())
    return digest.hexdigest()


def _code_digest() -> dict[str, object]:
    """The warm-up's code: the relax packages' source files, library versions, Python and machine."""
    sources = hashlib.sha256()
    for name in _CODE_PACKAGES:
        spec = importlib.util.find_spec(name)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            for path in sorted(Path(root).rglob("*.py")):
                sources.update(f"{name}/{path.relative_to(root).as_posix()}\0".encode())
                sources.update(path.read_bytes())
    versions: dict[str, str | None] = {}
    for lib in _LIBRARIES:
        try:
            versions[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            versions[lib] = None
    return {
        "sources": sources.hexdigest(),
        "libraries": versions,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }


def _item_record(entry: WarmupItem) -> dict[str, object]:
    # What the warm-up reads of a row: its prompt, its media by content and its valid options; not where the
    # row or its files live (each run folder may hold its own copy of the same files).
    item, options = entry
    record = item["item"]
    return {
        "info": {k: v for k, v in item.items() if k not in ("id", "item")},
        "messages": [asdict(m) for m in record.messages],
        "media": [
            {
                "kind": m.kind,
                "meta": m.meta,
                "bytes": _sha256_file(Path(m.path)) if m.path else hashlib.sha256(m.data or b"").hexdigest(),
            }
            for m in record.media
        ],
        "options": list(options),
    }


def warmup_inputs(cfg: RunConfig, items: Sequence[WarmupItem], checkpoint: Path) -> dict[str, object]:
    """Everything the warm-up of ``cfg`` on ``items`` reads, as JSON-ready values (the key digests this).

    Args:
        cfg: The run's resolved config.
        items: The training items, in the order the warm-up receives them.
        checkpoint: The folder ``cfg.model.source`` resolves to.
    """
    dumped = cfg.model_dump(mode="json")
    config = {
        section: {k: v for k, v in dumped[section].items() if k not in UNREAD_FIELDS.get(section, {})}
        for section in SECTIONS
    }
    return {
        "format": _FORMAT,
        "checkpoint": folder_digest(checkpoint),
        "config": config,
        "items": hashlib.sha256(
            json.dumps([_item_record(i) for i in items], sort_keys=True, default=str).encode()
        ).hexdigest(),
        "code": _code_digest(),
    }


def warmup_key(inputs: dict[str, object]) -> str:
    """The cache key of :func:`warmup_inputs`' result."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def _entry(key: str, cache: Path | None) -> Path:
    if cache is None:
        from relax_services.models._light import cache_dir

        cache = cache_dir()
    return cache / "warmup" / key


def _complete(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED)


def cached_warmup(key: str, cache: Path | None = None) -> Path | None:
    """The complete cache entry of ``key``, or None (``cache``: the model cache when not given)."""
    entry = _entry(key, cache)
    return entry if _complete(entry) else None


def store_warmup(
    key: str,
    result: Path,
    info: dict[str, object],
    inputs: dict[str, object],
    cache: Path | None = None,
    keep: int = KEEP_ENTRIES,
) -> Path:
    """Store the warm-up checkpoint folder ``result`` with its metrics ``info`` as the entry of ``key``, then prune
    the cache to its ``keep`` most recently used entries (:func:`prune_warmups`).

    Returns:
        The entry (another run's, when it stored the same key first).
    """
    entry = _entry(key, cache)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=entry.parent))
    try:
        shutil.copytree(result, tmp, dirs_exist_ok=True)
        (tmp / _INPUTS_FILE).write_text(json.dumps(inputs, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        (tmp / INFO_FILE).write_text(json.dumps(info, sort_keys=True) + "\n", encoding="utf-8")
        try:
            tmp.rename(entry)
        except OSError:  # another run stored this key first: keep its (equal) entry
            if not _complete(entry):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    prune_warmups(entry.parent, keep)
    return entry


def _last_used(entry: Path) -> float:
    """When ``entry`` was stored or last hit (its info file's modification time; 0 if it went meanwhile)."""
    try:
        return (entry / INFO_FILE).stat().st_mtime
    except OSError:
        return 0.0


def _discard(folder: Path) -> None:
    """Remove ``folder``: renamed aside first (atomic), so no reader ever sees part of an entry."""
    trash = folder.with_name(f".trash-{folder.name}-{os.getpid()}-{os.urandom(4).hex()}")
    try:
        folder.rename(trash)
    except OSError:  # another run removed (or is removing) it
        return
    shutil.rmtree(trash, ignore_errors=True)


def prune_warmups(folder: Path, keep: int = KEEP_ENTRIES) -> list[str]:
    """Keep the ``keep`` most recently used entries of the warm-up cache ``folder`` (``<cache>/warmup``), remove the
    others and what killed stores left behind; safe with other runs storing, reading or pruning at once.

    Returns:
        The keys of the entries removed.

    Raises:
        ValueError: ``keep`` is negative.
    """
    if keep < 0:
        raise ValueError(f"prune_warmups: keep must be >= 0, got {keep}")
    try:
        children = list(folder.iterdir())
    except FileNotFoundError:
        return []
    entries = [p for p in children if not p.name.startswith(".") and p.is_dir()]
    entries.sort(key=lambda p: (_last_used(p), p.name), reverse=True)
    removed = entries[keep:]
    for entry in removed:
        _discard(entry)
    now = time.time()
    for private in (p for p in children if p.name.startswith(".") and p.is_dir()):
        with contextlib.suppress(OSError):  # another run's live store is minutes old at most
            if now - private.stat().st_mtime > _STALE_PRIVATE_S:
                shutil.rmtree(private, ignore_errors=True)
    return [p.name for p in removed]


def restore_warmup(entry: Path, out: Path) -> dict[str, object]:
    """Copy the cache ``entry`` to the checkpoint folder ``out`` (written aside and renamed into place) and mark the
    entry used now (pruning keeps the most recently used); returns the warm-up's metrics record.

    Raises:
        FileNotFoundError: the entry was pruned (by another run) before or while it was copied.
    """
    os.utime(entry / INFO_FILE)  # first: an entry in use is the newest, the last another run's prune removes
    info: dict[str, object] = json.loads((entry / INFO_FILE).read_text(encoding="utf-8"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        try:
            shutil.copytree(entry, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns(INFO_FILE, _INPUTS_FILE))
        except shutil.Error as exc:  # copytree gathers each file's error: the entry was renamed away mid-copy
            if not _complete(entry):
                raise FileNotFoundError(f"warm-up cache entry {entry} was removed while it was copied") from exc
            raise
        if not (out / "config.json").is_file():  # else an earlier restore of this run's warm-up is complete
            shutil.rmtree(out, ignore_errors=True)  # what an interrupted warm-up of this run folder left
            os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def load_or_run(
    cfg: RunConfig,
    items: Sequence[WarmupItem],
    out: Path,
    run: Callable[[], dict[str, object]],
    cache: Path | None = None,
) -> dict[str, object]:
    """The warm-up checkpoint of ``cfg`` on ``items`` in ``out``: copied from the cache on a hit (``run`` is not
    called, so no warm-up process starts), else made by ``run`` (which writes ``out`` and returns the metrics
    record) and stored.

    Returns:
        The warm-up's metrics record with ``cached`` (whether it came from the cache) and ``key``.
    """
    from relax_services.models.source_check import check_source

    inputs = warmup_inputs(cfg, items, check_source(cfg.model.source, cfg.model.seed))
    key = warmup_key(inputs)
    entry = cached_warmup(key, cache)
    if entry is not None:
        try:
            return {**restore_warmup(entry, out), "path": str(out), "cached": True, "key": key}
        except FileNotFoundError:  # another run pruned the entry meanwhile: a miss after all
            pass
    info = run()
    store_warmup(key, out, info, inputs, cache)
    return {**info, "cached": False, "key": key}


def format_warmup_task(
    cfg: RunConfig, items: Sequence[WarmupItem], to_prompt: PromptBuilder, out_dir: str, seed: int = 0
) -> tuple[dict[str, object], str, int]:
    """:func:`relax_services.control.warmup.format_warmup` imported where it runs: the driver hands this light
    function to a Ray task, whose process alone imports the warm-up's model stack. Returns the warm-up's metrics
    record, and the Ray node and process id it ran in (the driver waits for that process to end before the
    services start)."""
    import os

    import ray

    from relax_services.control.warmup import format_warmup

    info = format_warmup(cfg, items, to_prompt, out_dir, seed)
    return info, ray.get_runtime_context().get_node_id(), os.getpid()

"""What ``relax train --resume`` runs with: the saved config of the run, plus the overrides that are safe to change.

A resumed run continues the run it names: the model, data, algorithm, batch sizes and seeds of its checkpoint.
Overrides on resume may change only how long and how it runs (:data:`SAFE_ON_RESUME`); any other change is a
config error naming the field, since it would silently train a different run from the same checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from relax_core import ConfigError, ConfigIssue
from relax_services.config import RunConfig, load_run_config

__all__ = ["SAFE_ON_RESUME", "resume_config"]

SAFE_ON_RESUME: tuple[str, ...] = (
    "trainer.total_steps",
    "optimizer.total_steps",
    "trainer.max_minutes",
    "trainer.target_reward",
    "trainer.checkpoint_every",
    "trainer.checkpoint_every_s",
    "trainer.keep_checkpoints",
    "trainer.world_size",
    "eval.every_steps",
    "trainer.gpus_per_rank",
    "trainer.fsdp",
    "rollout.gpus",
    "reference.gpus",
    "critic.gpus",
    "eval.gpus",
    "rollout.vllm.gpu_memory_utilization",
    "rollout.vllm.enforce_eager",
    "health",
    "faults",
    "queue.lease_timeout_s",
    "run",
    "metrics",
)
"""Dotted keys (or whole sections) an override may change on ``--resume``: the run's length and budget, how often
it checkpoints and evaluates, the ranks of a Trainer group (its checkpoint holds the full state, which a group of
any world size loads; the updates stay the same to float rounding), fault handling, where and how it reports
(``run``, ``metrics``), and the GPUs each process reserves."""

_IDENTITY = ("run.output_dir", "run.name")  # name the run folder; the saved copy may spell them differently


def _flatten(data: object, prefix: str = "") -> dict[str, object]:
    if isinstance(data, dict) and data:
        out: dict[str, object] = {}
        for key, value in data.items():
            out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: data}


def _safe(key: str) -> bool:
    return any(key == s or key.startswith(s + ".") for s in SAFE_ON_RESUME)


def resume_config(
    run_dir: Path, source: str | Path | None, overrides: list[str]
) -> tuple[RunConfig, dict[str, tuple[object, object]]]:
    """The config a resumed run continues with, and what the overrides changed (``key: (saved, new)``).

    Raises:
        ConfigError: when the run folder has no saved config, a config file is given (the saved one is the
            run's), or an override changes a field outside :data:`SAFE_ON_RESUME`.
    """
    saved_file = run_dir / "config.yaml"
    if source is not None:
        raise ConfigError(
            [ConfigIssue("--resume", str(source), "continues the run's saved config; give changes as overrides")]
        )
    if not saved_file.is_file():
        raise ConfigError([ConfigIssue("--resume", str(run_dir), "the run folder has no config.yaml to continue")])
    saved_data = yaml.safe_load(saved_file.read_text(encoding="utf-8")) or {}
    optimizer, trainer = saved_data.get("optimizer") or {}, saved_data.get("trainer") or {}
    if optimizer.get("total_steps") == trainer.get("total_steps"):
        optimizer.pop("total_steps", None)  # derived from the run length: a longer resumed run stretches it
    saved = load_run_config(saved_data)
    cfg = load_run_config(saved_data, overrides)
    before, after = _flatten(saved.model_dump(mode="json")), _flatten(cfg.model_dump(mode="json"))
    changed = {
        key: (before.get(key), after.get(key))
        for key in sorted(set(before) | set(after))
        if key not in _IDENTITY and before.get(key) != after.get(key)
    }
    unsafe = [k for k in changed if not _safe(k)]
    if unsafe:
        raise ConfigError(
            [
                ConfigIssue(
                    key,
                    changed[key][1],
                    f"cannot change on --resume (the saved run has {changed[key][0]!r})",
                    "changes of " + ", ".join(SAFE_ON_RESUME),
                )
                for key in unsafe
            ]
        )
    # The run folder is the one named on the command line (the saved copy may hold a relative output_dir).
    named = load_run_config(None, overrides).run
    cfg = cfg.model_copy(
        update={"run": cfg.run.model_copy(update={"output_dir": named.output_dir, "name": named.name})}
    )
    return cfg, changed

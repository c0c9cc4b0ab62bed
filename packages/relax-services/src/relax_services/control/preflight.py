"""Checks of a run config against the machine, before any heavy import and before Ray starts.

`load_run_config` checks a config's values; these check what the values point at: the model and data folders
exist, the reward function and the modules it requires are found, the environment's file or module exists, the
package a chosen engine needs (vLLM) is installed, the output folder can be written, and a run to resume exists. Every
problem becomes a :class:`~relax_core.ConfigIssue` naming its field, so ``relax train`` reports a bad path
in about a second instead of as a traceback from a service minutes later. Nothing here imports torch,
transformers or ray.
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
from pathlib import Path

from relax_core import REWARD_REGISTRY, ConfigError, ConfigIssue
from relax_services.config import RunConfig
from relax_services.engines.registry import (
    OWN_PROCESS_ROLLOUT_ENGINES,
    TEXT_ONLY_ROLLOUT_ENGINES,
    missing_engine_package,
    missing_package_reason,
)

__all__ = ["check_run", "complete_checkpoints", "make_run_dir", "run_dir_of"]

TINY_OMNI = "tiny-omni"
_CHECKPOINT = re.compile(r"^step_(\d{8})$")
_CHECKPOINT_FILES = ("engine.pt", "controller.pt", "prompts.queue", "samples.queue")


def run_dir_of(cfg: RunConfig) -> Path:
    """The run folder a config names: ``run.output_dir / run.name`` (a timestamp when unnamed)."""
    name = cfg.run.name or time.strftime("%Y%m%d-%H%M%S")
    return (cfg.run.output_dir / name).resolve()


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's checkpoint folders that hold every file of a checkpoint, oldest first (no file is read)."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if _CHECKPOINT.match(p.name) and p.is_dir()]
    return sorted(p for p in found if all((p / f).is_file() for f in _CHECKPOINT_FILES))


def _check_model(cfg: RunConfig) -> list[ConfigIssue]:
    source = cfg.model.source
    if source == TINY_OMNI:
        return []
    path = Path(source).expanduser()
    if not path.exists():
        return [ConfigIssue("model.source", source, f"no such folder; use {TINY_OMNI!r} or a local checkpoint")]
    if not (path / "config.json").is_file():
        return [ConfigIssue("model.source", source, "not a transformers checkpoint folder (no config.json in it)")]
    return []


def _check_files(cfg: RunConfig) -> list[ConfigIssue]:
    """Each dataset file exists (its form and columns are checked once relax-modalities is loaded)."""
    issues = []
    for name, files in (("data.train_files", cfg.data.train_files), ("data.eval_files", cfg.data.eval_files)):
        for spec in files:
            if not Path(spec.path).exists():
                issues.append(ConfigIssue(name, spec.path, "no such file or folder"))
    if cfg.data.eval_files and not cfg.data.train_files:
        issues.append(ConfigIssue("data.eval_files", [f.path for f in cfg.data.eval_files], "needs data.train_files"))
    return issues


def _check_data(cfg: RunConfig) -> list[ConfigIssue]:
    if cfg.data.train_files or cfg.data.eval_files:
        return _check_files(cfg)
    folder = cfg.data.data_dir
    if folder is None:
        return []
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "no such folder"
        return [
            ConfigIssue(
                "data.data_dir",
                str(folder),
                f"{what}; point it at a folder to keep the synthetic tasks' dataset files in, or leave it unset "
                "to keep them in the cache",
            )
        ]
    return []


def _check_reward_fn(fn: str) -> list[ConfigIssue]:
    file_part, sep, _ = fn.rpartition(":")
    if sep and file_part.endswith(".py"):
        if not Path(file_part).is_file():
            return [ConfigIssue("reward.fn", fn, f"no such file {file_part!r}", "path/to/file.py:function")]
        return []
    module = file_part if sep else fn.rpartition(".")[0]
    try:
        found = bool(module) and importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that does not exist
        found = False
    if not found and fn not in REWARD_REGISTRY:
        return [ConfigIssue("reward.fn", fn, f"cannot find module {module!r}", "module:function or file.py:function")]
    return []


def _check_env(cfg: RunConfig) -> list[ConfigIssue]:
    """``rollout.env``'s (or ``rollout.agent``'s) file exists or its module is found (the class and its tools, or
    the agent function and its signature, are read where the rollout loads it: a user's module may import the model
    stack)."""
    for name, spec, what in (("rollout.env", cfg.rollout.env, "Class"), ("rollout.agent", cfg.rollout.agent, "fn")):
        if spec is None:
            continue
        where, sep, attr = spec.rpartition(":")
        if not sep or not where or not attr:
            expected = "a class" if what == "Class" else "a function"
            return [ConfigIssue(name, spec, f"expected {expected}", f"path/to/file.py:{what} or module:{what}")]
        if where.endswith(".py"):
            return [] if Path(where).is_file() else [ConfigIssue(name, spec, f"no such file {where!r}")]
        try:
            found = importlib.util.find_spec(where) is not None
        except (ImportError, ValueError):  # a parent package that does not exist
            found = False
        return [] if found else [ConfigIssue(name, spec, f"cannot find module {where!r}")]
    return []


def _check_reward(cfg: RunConfig) -> list[ConfigIssue]:
    if cfg.reward.fn is not None:
        return _check_reward_fn(cfg.reward.fn)
    name = cfg.reward.name
    if name in REWARD_REGISTRY:
        return []
    module, sep, attr = name.partition(":") if ":" in name else name.rpartition(".")
    known = ", ".join(sorted(REWARD_REGISTRY))
    if not sep or not module or not attr:
        return [ConfigIssue("reward.name", name, "unknown reward", f"{known}, or a dotted path 'pkg.module:fn'")]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that does not exist
        found = False
    if not found:
        return [ConfigIssue("reward.name", name, f"cannot find module {module!r}", f"{known}, or an importable path")]
    return []


def _check_requirements(cfg: RunConfig) -> list[ConfigIssue]:
    """Every module of ``reward.requirements`` is found in this environment (found, not imported)."""
    issues = []
    for module, package in cfg.reward.required_modules().items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package that does not exist
            found = False
        if not found:
            reason = (
                f"the reward needs module {module!r}, which is not installed: in your project run "
                f"`uv add --group reward {package!r}` once, then sync with `uv sync --locked --all-packages --group "
                f"reward` (a plain `uv sync --locked --all-packages` leaves the reward group out and removes it)"
            )
            issues.append(ConfigIssue("reward.requirements", module, reason))
    return issues


def _check_engines(cfg: RunConfig) -> list[ConfigIssue]:
    """The optional package a chosen engine needs is installed (found, not imported: vLLM's import takes seconds)."""
    issues = []
    for field, name in (("rollout.engine", cfg.rollout.engine), ("trainer.engine", cfg.trainer.engine)):
        package = missing_engine_package(field, name)
        if package is not None:
            issues.append(ConfigIssue(field, name, missing_package_reason(package)))
    media = [t for t in cfg.data.tasks if t != "text"]
    if cfg.rollout.engine in TEXT_ONLY_ROLLOUT_ENGINES and media and not cfg.data.train_files:
        issues.append(
            ConfigIssue(
                "data.tasks",
                cfg.data.tasks,
                f"rollout.engine={cfg.rollout.engine!r} takes text prompts only, and {media} are media tasks",
                "data.tasks=[text]",
            )
        )
    if cfg.rollout.engine in OWN_PROCESS_ROLLOUT_ENGINES and cfg.run.mode == "colocated" and cfg.run.device != "cuda":
        issues.append(
            ConfigIssue(
                "run.mode",
                cfg.run.mode,
                f"rollout.engine={cfg.rollout.engine!r} needs a process of its own per engine on the CPU, which the "
                "colocated mode (every service a thread of one process) cannot give",
                "run.mode=distributed, or run.device=cuda",
            )
        )
    return issues


def _check_output(cfg: RunConfig, run_dir: Path) -> list[ConfigIssue]:
    """The run folder can be created and written: the nearest existing folder above it is a writable folder."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        blocker = "run.output_dir" if existing == cfg.run.output_dir.resolve() else "a path above the run folder"
        return [ConfigIssue("run.output_dir", str(cfg.run.output_dir), f"{blocker} is a file: {existing}")]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [ConfigIssue("run.output_dir", str(cfg.run.output_dir), f"cannot write into {existing}")]
    return []


def _check_resume(cfg: RunConfig, run_dir: Path) -> list[ConfigIssue]:
    if cfg.run.name is None:
        return [ConfigIssue("run.name", None, "--resume needs the name of the run to continue (run.name=...)")]
    if not run_dir.is_dir():
        return [ConfigIssue("run.name", cfg.run.name, f"--resume: no run folder {run_dir}")]
    if not complete_checkpoints(run_dir):
        return [
            ConfigIssue(
                "run.name",
                cfg.run.name,
                f"--resume: {run_dir} holds no complete checkpoint (the run stopped before its first one); "
                "start it again without --resume",
            )
        ]
    return []


def check_run(cfg: RunConfig, *, resume: bool = False) -> Path:
    """Every check of this module; returns the run folder (not created).

    Raises:
        ConfigError: listing each problem with its field.
    """
    run_dir = run_dir_of(cfg)
    issues = [
        *_check_model(cfg),
        *_check_data(cfg),
        *_check_reward(cfg),
        *_check_requirements(cfg),
        *_check_env(cfg),
        *_check_engines(cfg),
    ]
    issues += _check_output(cfg, run_dir)
    if resume:
        issues += _check_resume(cfg, run_dir)
    if issues:
        raise ConfigError(issues)
    return run_dir


def make_run_dir(cfg: RunConfig, run_dir: Path | None = None) -> Path:
    """Create the run folder ``run_dir`` (default :func:`run_dir_of`).

    Raises:
        ConfigError: naming ``run.output_dir`` when the folder cannot be created there.
    """
    run_dir = run_dir or run_dir_of(cfg)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            [ConfigIssue("run.output_dir", str(cfg.run.output_dir), f"cannot create {run_dir}: {exc.strerror}")]
        ) from None
    return run_dir

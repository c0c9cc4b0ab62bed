"""The GPU check (``packages/relax-services/scripts/gpu_check.sh --out DIR [--device cuda|cpu]``): one command that
runs what this repository can only verify on a GPU machine and writes the results to ``DIR/gpu_check.json``.

``--device cuda`` (the default; a CUDA machine with vLLM installed, ``relax-services[vllm]``): on one GPU at most
≈ 8 minutes by the time limits below (:data:`TESTS_TIMEOUT_S`, :data:`RUN_TIMEOUT_S` per layout; not yet measured on a
GPU), 5 more for the second layout on two:

1. ``pytest -m gpu packages/`` (the tests that skip without CUDA), its passed / failed / skipped counts read from
   a junit xml (``DIR/gpu_tests.xml``).
2. A checkpoint of Qwen2.5-0.5B's published shape (:data:`QWEN25_05B_SHAPE`) with random weights and the tiny
   tokenizer (:func:`~relax_services.models.tiny_families.write_tiny_checkpoint`; nothing is downloaded). Its
   vocabulary is the tiny tokenizer's 64 tokens, so the model has ≈ 0.36 B parameters, not the published 0.49 B
   (the 151,936-token embedding is the difference); the JSON reports both.
3. ``relax train`` on it, 20 updates of the synthetic text task with the vLLM rollout engine, per layout:
   ``colocated`` (trainer and rollout share GPU 0 through fractional GPU counts) and, when ``nvidia-smi -L`` lists
   two GPUs or more, ``split`` (one GPU each).
4. Per layout, from the run folder's ``metrics.jsonl`` (:mod:`relax_services.bench.gpu_report`): updates,
   seconds, samples/s and tokens/s, weight-sync seconds and GB/s per version, peak device memory per service, and
   the rollout/trainer log-prob mismatch.

``--device cpu`` (the default test suite runs it end to end) skips step 1: without CUDA every ``gpu`` test skips,
and collecting the suite alone takes ≈ 20 s on 2 cores. It builds the tiny Qwen2 instead and runs 2 updates with
the transformers engine in ``run.mode=colocated`` (every service a thread of one process, no Ray): ≈ 20 s on 2
cores (the distributed mode's Ray start-up alone would take longer).

Run folders, logs and the model are written under ``DIR``, which must be empty or new. The exit code is 0 when
every test passed or skipped and every layout's run ended with exit code 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Literal

from relax_services.bench.gpu_report import (
    Device,
    Gpu,
    JunitCounts,
    LayoutRun,
    Machine,
    ModelInfo,
    PytestStep,
    Report,
    SkippedLayout,
    format_report,
    passed,
    summarize_metrics,
)

__all__ = [
    "CUDA_LAYOUTS",
    "QWEN25_05B_SHAPE",
    "QWEN25_05B_VOCAB",
    "RUN_TIMEOUT_S",
    "TESTS_TIMEOUT_S",
    "Layout",
    "RolloutEngine",
    "build_checkpoint",
    "check",
    "default_rollout_engine",
    "gpu_count",
    "layouts",
    "machine_info",
    "main",
    "parse_junit",
    "rollout_engine_overrides",
    "run_gpu_tests",
    "run_layout",
    "train_overrides",
]

QWEN25_05B_SHAPE: dict[str, object] = {
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
}
"""Qwen2.5-0.5B's published config (``Qwen/Qwen2.5-0.5B`` ``config.json``) less its vocabulary."""

QWEN25_05B_VOCAB = 151936
"""Qwen2.5-0.5B's published vocabulary size (its parameter count with it is reported beside the real one)."""

TESTS_TIMEOUT_S = 150
"""Limit of the ``pytest -m gpu`` step."""

RUN_TIMEOUT_S = {"cuda": 300, "cpu": 240}
"""Limit of one layout's ``relax train``; the run's own ``trainer.max_minutes`` stops it first, leaving time for its
final checkpoint and evaluation."""

_COMMON = (
    "data.tasks=[text]",
    "trainer.warmup_format_steps=0",
    "trainer.target_reward=null",
    "run.progress=none",
    "model.export_hf=false",
)
_SIZES = {
    # 20 updates of 8 groups × 8 samples of up to 32 tokens; evaluations at versions 0, 10, 20; checkpoints at the
    # first and last versions only (the model and its Adam state are ≈ 4 GB)
    "cuda": (
        "trainer.total_steps=20",
        "trainer.groups_per_step=8",
        "algorithm.group_size=8",
        "rollout.groups_per_call=8",
        "rollout.max_new_tokens=32",
        "data.train_per_task=256",
        "data.eval_per_task=16",
        "eval.every_steps=10",
        "trainer.max_minutes=3.5",
        "trainer.checkpoint_every=1000",
        "trainer.checkpoint_every_s=null",
    ),
    "cpu": (
        "trainer.total_steps=2",
        "trainer.groups_per_step=4",
        "algorithm.group_size=4",
        "data.train_per_task=16",
        "data.eval_per_task=4",
        "eval.every_steps=1000",
        "trainer.max_minutes=3",
        "run.mode=colocated",
    ),
}


@dataclass(frozen=True)
class Layout:
    """One placement of the run's roles: a name, what it is, and its ``relax train`` overrides."""

    name: str
    description: str
    overrides: tuple[str, ...]


_CPU_LAYOUT = Layout("cpu", "every service a thread of one process (run.mode=colocated), transformers engine", ())

CUDA_LAYOUTS = ("one-process", "colocated", "fsdp", "split")
"""The layouts a CUDA check can run, in order (``--layouts`` picks some)."""

RolloutEngine = Literal["vllm", "hf"]


def rollout_engine_overrides(engine: RolloutEngine) -> tuple[str, ...]:
    """The ``relax train`` overrides of the rollout engine (``vllm``: relax-services[vllm]; ``hf``: transformers,
    for a machine without vLLM)."""
    if engine == "vllm":
        return ("rollout.engine=vllm", "rollout.vllm.max_model_len=512")
    return ("rollout.engine=hf",)


def default_rollout_engine() -> RolloutEngine:
    """``vllm`` when it is installed, else ``hf``."""
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def layouts(
    device: Device, gpus: int, engine: RolloutEngine = "vllm", names: Sequence[str] = CUDA_LAYOUTS
) -> tuple[list[Layout], list[SkippedLayout]]:
    """The layouts of ``names`` to run on ``device`` with ``gpus`` GPUs and the ``engine`` rollout engine, and those
    left out (name and reason).

    On CUDA: ``one-process`` is every role a thread of one process on the GPU (``run.mode=colocated``, no Ray);
    ``colocated`` the distributed services sharing GPU 0 through fractional GPU counts; ``fsdp`` the same with the
    Trainer a group of one FSDP2 rank (NCCL); ``split`` the Trainer on one GPU and the Rollout process on another.
    The Reference and the Evaluator stand in the Rollout's process (``run.hosts``' default), which reserves the
    largest of their GPU counts; with vLLM the Rollout and the Evaluator each build an engine, so each takes a share
    of the GPU (``rollout.vllm.gpu_memory_utilization``) that leaves the Trainer its part.
    """
    if device == "cpu":
        return [_CPU_LAYOUT], []
    unknown = sorted(set(names) - set(CUDA_LAYOUTS))
    if unknown:
        raise ValueError(f"unknown layout(s) {', '.join(unknown)}; the CUDA layouts are {', '.join(CUDA_LAYOUTS)}")
    roles = ("trainer.gpus_per_rank", "rollout.gpus", "reference.gpus", "eval.gpus")

    def share(count: str, utilization: float) -> tuple[str, ...]:
        vllm = (f"rollout.vllm.gpu_memory_utilization={utilization}",) if engine == "vllm" else ()
        return (*(f"{f}={count}" for f in roles), *vllm)

    every = {
        "one-process": Layout(
            "one-process",
            "every role a thread of one process on GPU 0 (run.mode=colocated, no Ray)",
            ("run.mode=colocated", *(("rollout.vllm.gpu_memory_utilization=0.4",) if engine == "vllm" else ())),
        ),
        "colocated": Layout(
            "colocated", "trainer and rollout processes share GPU 0 (fractional GPU counts)", share("0.5", 0.25)
        ),
        "fsdp": Layout(
            "fsdp",
            "a Trainer group of one FSDP2 rank (NCCL) and the rollout process share GPU 0",
            ("trainer.engine=fsdp", "trainer.world_size=1", *share("0.5", 0.25)),
        ),
        "split": Layout(
            "split",
            "the trainer on one GPU, the rollout process (with reference and evaluator) on another",
            share("1", 0.4),
        ),
    }
    to_run: list[Layout] = []
    skipped: list[SkippedLayout] = []
    for name in (n for n in CUDA_LAYOUTS if n in names):
        if name == "split" and gpus < 2:
            skipped.append({"name": name, "reason": f"nvidia-smi -L lists {gpus} GPU(s); the layout needs 2"})
        else:
            to_run.append(every[name])
    return to_run, skipped


def train_overrides(
    device: Device, model: Path, out: Path, engine: RolloutEngine = "vllm", updates: int | None = None
) -> list[str]:
    """The ``relax train`` overrides every layout of ``device`` shares (``run.device`` among them); ``updates``
    replaces the default number of updates."""
    steps = () if updates is None else (f"trainer.total_steps={updates}", f"eval.every_steps={max(1, updates // 2)}")
    return [
        f"model.source={model}",
        f"data.data_dir={out / 'data'}",
        f"run.output_dir={out / 'runs'}",
        *_COMMON,
        *_SIZES[device],
        *(rollout_engine_overrides(engine) if device == "cuda" else ()),
        *steps,
        f"run.device={device}",
    ]


def gpu_count() -> int:
    """GPUs ``nvidia-smi -L`` lists (0 without ``nvidia-smi``)."""
    try:
        text = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in text.splitlines())


def machine_info() -> Machine:
    """Python, CPU count, the installed versions of the model stack, and each GPU from ``nvidia-smi`` (None when
    it is absent)."""
    versions: dict[str, str | None] = {}
    for name in ("torch", "transformers", "vllm", "ray"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return {"python": sys.version.split()[0], "cpus": os.cpu_count(), "packages": versions, "gpus": _gpus()}


def _gpus() -> list[Gpu] | None:
    """Each GPU's index, name, memory and driver from ``nvidia-smi`` (None when it is absent or fails)."""
    query = ["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader,nounits"]
    try:
        text = subprocess.run(query, capture_output=True, text=True, timeout=60, check=True).stdout
        gpus: list[Gpu] = []
        for line in text.strip().splitlines():
            index, name, memory, driver = (part.strip() for part in line.split(","))
            gpus.append({"index": int(index), "name": name, "memory_mib": int(memory), "driver": driver})
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    return gpus


def parse_junit(path: Path) -> JunitCounts:
    """Passed, failed, skipped and error counts of a pytest junit xml, and the ids of the tests that failed or
    erred."""
    counts: JunitCounts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "failed_tests": []}
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("failure") is not None:
            counts["failed"] += 1
        elif case.find("error") is not None:
            counts["errors"] += 1
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
            continue
        else:
            counts["passed"] += 1
            continue
        counts["failed_tests"].append(f"{case.get('classname')}::{case.get('name')}")
    return counts


def run_gpu_tests(repo: Path, out: Path, paths: Sequence[str] = ("packages/",)) -> PytestStep:
    """Runs ``pytest -m gpu PATHS`` (default ``packages/``) in ``repo`` with a junit xml under ``out``; its exit code
    and counts (None when pytest wrote no xml: its log says why)."""
    xml = out / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", *paths, "-q", "-p", "no:cacheprovider"]
    cmd.append(f"--junitxml={xml}")
    log = out / "gpu_tests.log"
    rc, seconds = _run(cmd, log, TESTS_TIMEOUT_S, cwd=repo)
    counts = parse_junit(xml) if xml.exists() else None
    broken = counts is None or counts["failed"] + counts["errors"] > 0
    return {
        "ran": True,
        "reason": None,
        "command": cmd,
        "returncode": rc,
        "seconds": round(seconds, 1),
        "log": str(log),
        "log_tail": _tail(log) if broken else None,
        "counts": counts,
    }


def build_checkpoint(device: Device, folder: Path) -> ModelInfo:
    """Writes the check's Qwen2 checkpoint (``cuda``: :data:`QWEN25_05B_SHAPE`, ``cpu``: the tiny one) with random
    weights and the tiny tokenizer into ``folder``; what was built and its parameter count (from the weights
    files)."""
    from relax_services.models.tiny_families import write_tiny_checkpoint

    start = time.monotonic()
    shape = QWEN25_05B_SHAPE if device == "cuda" else None
    write_tiny_checkpoint(folder, "qwen2", seed=0, shape=shape)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    parameters = _parameter_count(folder)
    hidden, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    published = parameters + (QWEN25_05B_VOCAB - vocab) * hidden  # tied: one embedding matrix
    return {
        "path": str(folder),
        "family": "qwen2",
        "shape": "Qwen2.5-0.5B (published config, random weights)" if shape else "tiny (random weights)",
        "hidden_size": hidden,
        "num_hidden_layers": int(config["num_hidden_layers"]),
        "vocab_size": vocab,
        "parameters": parameters,
        "parameters_with_published_vocab": published if shape else None,
        "note": (
            f"the tiny tokenizer's {vocab}-token vocabulary, not the published {QWEN25_05B_VOCAB}: the published "
            f"parameter count ({published / 1e9:.2f} B) is not reached"
        )
        if shape
        else None,
        "seconds": round(time.monotonic() - start, 1),
    }


def _parameter_count(folder: Path) -> int:
    """Parameters in the folder's safetensors files (a tied matrix is stored once), read from their headers."""
    from safetensors import safe_open

    total = 0
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            total += sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118  # no __iter__
    return total


def run_layout(layout: Layout, overrides: list[str], out: Path, timeout_s: float) -> LayoutRun:
    """Runs ``relax train`` in ``layout`` (run folder ``out/runs/<name>``, log ``out/<name>.log``) and summarises its
    ``metrics.jsonl``."""
    cmd = [
        sys.executable,
        "-m",
        "relax_services.cli",
        "train",
        *overrides,
        *layout.overrides,
        f"run.name={layout.name}",
    ]
    log = out / f"{layout.name}.log"
    rc, seconds = _run(cmd, log, timeout_s)
    run_dir = out / "runs" / layout.name
    metrics = run_dir / "metrics.jsonl"
    figures = summarize_metrics(metrics) if metrics.exists() else None
    error = None
    if rc != 0:
        ended = "stopped at its time limit" if rc is None else f"exited with {rc}"
        error = f"relax train {ended}{'' if figures else ', no metrics.jsonl'}; see {log}"
    return {
        "name": layout.name,
        "description": layout.description,
        "command": cmd,
        "returncode": rc,
        "command_s": round(seconds, 1),
        "run_dir": str(run_dir),
        "log": str(log),
        "log_tail": None if error is None else _tail(log),
        "figures": figures,
        "error": error,
    }


def _run(cmd: list[str], log: Path, timeout_s: float, cwd: Path | None = None) -> tuple[int | None, float]:
    """Runs ``cmd`` with its output in ``log``; on timeout SIGTERM (a run stops and checkpoints), then SIGKILL of its
    process group. Returns the exit code (None after a timeout) and the seconds it ran."""
    start = time.monotonic()
    with log.open("w", encoding="utf-8") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
            f.write(f"\ngpu_check: stopped after the {timeout_s:.0f} s limit\n")
    return rc, time.monotonic() - start


def _tail(log: Path, lines: int = 30) -> list[str]:
    """The last ``lines`` lines of ``log`` (so that the JSON alone shows why a step failed)."""
    return log.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]


def check(
    device: Device,
    out: Path,
    repo: Path,
    engine: RolloutEngine = "vllm",
    names: Sequence[str] = CUDA_LAYOUTS,
    updates: int | None = None,
    test_paths: Sequence[str] = ("packages/",),
) -> Report:
    """Runs the check's steps on ``device`` with everything written under ``out`` (on CUDA the ``engine`` rollout
    engine, the layouts of ``names`` the machine has, ``updates`` updates each when given); the report."""
    started = time.monotonic()
    machine = machine_info()
    tests: PytestStep
    if device == "cuda":
        tests = run_gpu_tests(repo, out, test_paths)
    else:
        tests = {
            "ran": False,
            "reason": "--device cpu: without CUDA every gpu-marked test skips",
            "command": None,
            "returncode": None,
            "seconds": None,
            "log": None,
            "log_tail": None,
            "counts": None,
        }
    model = build_checkpoint(device, out / "model")
    (out / "data").mkdir()
    overrides = train_overrides(device, out / "model", out, engine, updates)
    to_run, skipped = layouts(device, gpu_count() if device == "cuda" else 0, engine, names)
    return {
        "device": device,
        "rollout_engine": engine if device == "cuda" else "hf",
        "machine": machine,
        "tests": tests,
        "model": model,
        "layouts": [run_layout(layout, overrides, out, RUN_TIMEOUT_S[device]) for layout in to_run],
        "layouts_skipped": skipped,
        "seconds": round(time.monotonic() - started, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m relax_services.bench.gpu_check --out DIR [--device cuda|cpu] [--repo ROOT]``: runs the check,
    writes ``DIR/gpu_check.json``, prints a summary; returns 0 when :func:`passed`, 1 otherwise, 2 for a bad
    ``--out``."""
    parser = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for the results (empty or new)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="repository root (for the tests' step)")
    parser.add_argument(
        "--rollout-engine",
        choices=("vllm", "hf"),
        default=None,
        help="CUDA rollout engine (default: vllm when installed, else hf, the transformers engine)",
    )
    parser.add_argument(
        "--layouts",
        default=",".join(CUDA_LAYOUTS),
        help=f"comma-separated CUDA layouts to run (default: all the machine has: {','.join(CUDA_LAYOUTS)})",
    )
    parser.add_argument("--updates", type=int, default=None, help="updates per layout (default: 20 on CUDA)")
    parser.add_argument(
        "--tests",
        nargs="+",
        default=["packages/"],
        help="paths of the gpu-marked tests' step, relative to --repo (default: packages/)",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = sorted(set(names) - set(CUDA_LAYOUTS))
    if unknown or (args.updates is not None and args.updates < 1):
        problem = f"--layouts: unknown {', '.join(unknown)}" if unknown else f"--updates {args.updates} is below 1"
        print(f"gpu_check: {problem} (layouts: {', '.join(CUDA_LAYOUTS)})", file=sys.stderr)
        return 2
    out = args.out.resolve()
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        print(f"gpu_check: --out {out} must be an empty or new folder", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    engine: RolloutEngine = args.rollout_engine or default_rollout_engine()
    report = check(args.device, out, args.repo.resolve(), engine, names, args.updates, args.tests)
    path = out / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(format_report(report) + f"\nwrote {path}", flush=True)
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())

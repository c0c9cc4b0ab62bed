"""``relax bench trl``: TRL's ``GRPOTrainer`` against relax (colocated at τ = 0 and τ = 2, distributed at τ = 2) on
one task, one after the other in one run, side by side with ratios.

Colocated runs every role as a thread of one process: at τ ≥ 1 rollout and training then overlap only inside torch
kernels (the GIL), so on two cores with a tiny model τ = 2 is no faster than τ = 0. The distributed side runs the
rollout, reward and trainer in their own processes, so at τ ≥ 1 rollout uses the second core while the trainer
computes; its table rows show where each update's seconds go (relax's per-update split).

The task: single-digit addition. A prompt is ``a+b=`` with digits 0 ≤ a, b ≤ 4 (all 25 pairs); the
completion is one token, and the reward is relax-core's ``exact_match_reward`` (1 when the decoded completion is the
sum, else 0), the same function on both sides. Both start from random weights with no supervised warm-up, so a
random policy scores about 1/55 (the 64-token vocabulary less its 9 never-sampled ids); one-token answers keep that
rate high enough for GRPO to find the signal from scratch (with an end-of-answer token as well it would be about
1/55², and neither side learns).

Held equal: the model — one ``Qwen2ForCausalLM`` checkpoint folder written from a config (width 64, 2 layers,
4 heads, 2 KV heads, FFN 128, untied head, the same initial weights) with relax's 64-token character tokenizer
and chat template, which TRL loads with ``from_pretrained`` and relax as ``model.source`` — the prompt ids
(``<|im_start|>user\\na+b=<|im_end|>\\n<|im_start|>assistant\\n``, 12 ids rendered by the folder's chat
template; TRL's side stops when its tokenizer gives others), group size, prompts per update,
completion length, temperature, learning rate (constant), Adam, gradient clip, clip ε, β = 0 (no KL), no entropy bonus,
per-sequence-token-mean loss, group-std advantage scaling, one optimizer step per batch, the ids never sampled,
the prompt order (:func:`prompt_schedule`: each update 16 distinct prompts of a fresh permutation, as TRL's sampler
draws them; both sides read the one schedule unshuffled), the seed (initial weights, prompt order, sampling),
torch and its thread count (TRL runs on this environment's torch through a venv layered over it, at relax's one
intra-op thread).

Not held equal: the ε added to the group std (TRL 1e-4, relax-core 1e-6; with 0/1 rewards a group's unbiased std is
0 or at least sqrt(1/n) ≥ 0.25 for n ≤ 16, so the two scale an advantage within 4e-4 of each other, and a
uniform group's advantages are 0 either way); relax also computes the final held-out evaluation, which TRL does
not; the random streams (TRL
samples through ``generate`` on torch's global generator, relax on a generator seeded per rollout call), so one
seed's two runs are two draws, not one run twice: compare sides over several seeds (``--seeds``).

``relax bench trl --config`` runs the same sides on a user's run config instead of this task
(:mod:`relax_services.bench.trl_config`).

Measured per side, from one clock: command → first update, median seconds per update (between consecutive
updates, the first ten skipped), samples/s, updates and wall seconds from the command until the moving average
(over ten updates) of the training reward reaches each threshold, and the peak PSS of the side's process tree.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

from relax_services.bench.trl_figures import (
    SideResult,
    crossing,
    format_spread,
    format_table,
    summarise,
)
from relax_services.reporting.footprint import PeakMemory

TRL_SIDE_SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "trl_side.py"
"""The script TRL's own interpreter runs (it imports TRL, not relax): beside relax-services' other benchmark
scripts, outside the wheel."""

__all__ = [
    "RELAX_MODES",
    "BenchSettings",
    "SideResult",
    "check_updates",
    "crossing",
    "format_spread",
    "format_table",
    "prompt_schedule",
    "relax_overrides",
    "run_trl_bench",
    "summarise",
]

N_PROMPTS = 25  # the task's prompts: a+b= for 0 <= a, b <= 4
SCHEDULE_SLACK = 8  # updates of prompts in the schedule past the last update (relax's admission runs ahead at τ > 0)
TRL_VERSION = "1.16.0"
RELAX_MODES = ("colocated", "distributed")  # relax's run.mode values a relax side can take


@dataclass(frozen=True)
class BenchSettings:
    """The task's learning settings, the same on both sides (the rest of :class:`BenchHParams` is fixed).

    The defaults are the settings under which both sides reach the 0.8 threshold on most seeds: 8 prompts × 16
    completions. With 16 × 8 (the same 128 samples per update) at lr 1e-3 both sides collapse onto confident wrong
    answers for some prompts (a group of 8 that all miss carries no signal) and reach 0.8 in about 2 runs of 6;
    lr 2e-3 collapses more often, lr 5e-4 and 4 × 32 are slower (docs/benchmarks.md has the figures).

    Attributes:
        lr: Learning rate, constant.
        group_size: Completions per prompt (GRPO's group).
        groups_per_step: Prompts per update (of the 25; each update's are distinct).
    """

    lr: float = 1e-3
    group_size: int = 16
    groups_per_step: int = 8

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"bench lr must be > 0, got {self.lr}")
        if self.group_size < 2:
            raise ValueError(f"bench group_size must be >= 2 (a group's std needs two samples), got {self.group_size}")
        if not 1 <= self.groups_per_step <= N_PROMPTS:
            raise ValueError(f"bench groups_per_step must be in 1..{N_PROMPTS}, got {self.groups_per_step}")


class BenchHParams(TypedDict):
    """The hyper-parameters both sides train with (sent to TRL's side as JSON)."""

    updates: int
    seed: int
    group_size: int
    groups_per_step: int
    max_new_tokens: int
    temperature: float
    lr: float
    grad_clip: float
    clip_eps: float
    suppressed_ids: list[int]
    intra_op_threads: int


def _hparams(updates: int, seed: int, work: Path, settings: BenchSettings | None = None) -> BenchHParams:
    from relax_services.engines._threads import DEFAULT_INTRA_OP_THREADS
    from relax_services.models import open_checkpoint

    settings = settings or BenchSettings()
    return {
        "updates": updates,
        "seed": seed,
        "group_size": settings.group_size,
        "groups_per_step": settings.groups_per_step,
        "max_new_tokens": 1,
        "temperature": 1.0,
        "lr": settings.lr,
        "grad_clip": 1.0,
        "clip_eps": 0.2,
        "suppressed_ids": list(open_checkpoint(work / "model").tokens.never_sample),
        # relax computes with one intra-op thread per role; torch's default (one per core) made TRL's steps several
        # times slower whenever the machine was shared.
        "intra_op_threads": DEFAULT_INTRA_OP_THREADS,
    }


def _write_model(work: Path, seed: int) -> Path:
    """The policy both sides train: the tiny ``Qwen2ForCausalLM`` checkpoint folder of the family tests (width 64,
    2 layers, 4 heads, 2 KV heads, FFN 128, untied head; relax's 64-token tokenizer with its chat template) at
    ``work/model``, initial weights from ``seed``."""
    from relax_services.models.tiny_families import write_tiny_checkpoint

    return write_tiny_checkpoint(work / "model", "qwen2", seed)


def prompt_schedule(n_prompts: int, per_update: int, updates: int, seed: int) -> list[int]:
    """The prompt indices of ``updates`` consecutive updates, ``per_update`` each: every update takes the first
    ``per_update`` of a fresh random permutation of the ``n_prompts`` (what TRL's ``RepeatSampler`` does when an
    update's prompts are fewer than the dataset's: one permutation per epoch, the incomplete rest dropped), drawn
    from ``random.Random(seed)``."""
    if not 0 < per_update <= n_prompts:
        raise ValueError(f"per_update must be in 1..n_prompts={n_prompts}, got {per_update}")
    rng = random.Random(seed)
    order: list[int] = []
    for _ in range(updates):
        perm = list(range(n_prompts))
        rng.shuffle(perm)
        order += perm[:per_update]
    return order


def _write_task(work: Path, hp: BenchHParams) -> None:
    """The task for both sides, in one prompt order: relax's dataset files (``data/text.jsonl``, the 25 rows, for
    the held-out evaluation; ``data/schedule.jsonl``, the rows in :func:`prompt_schedule`'s order, read without
    shuffling) and TRL's prompt list in the same order (read without shuffling), rendered by the shared model
    folder's chat template. Without the shared order relax drew from its 1024-row shuffle buffer over passes of the
    25 rows (close to independent draws with replacement: about 12 distinct prompts per update where TRL has 16),
    which by itself cost updates to each threshold."""
    from relax_modalities.synthetic import TaskItem, task_item_row
    from relax_services.config import ModelConfig
    from relax_services.data.run_data import PromptBuilder
    from relax_services.models import open_checkpoint

    options = tuple(str(i) for i in range(10))
    items = [
        TaskItem(id=f"add-{a}{b}", task="text", prompt=f"{a}+{b}=", answer=str(a + b), options=options, chance=0.1)
        for a in range(5)
        for b in range(5)
    ]
    folder = work / "data"
    folder.mkdir(parents=True, exist_ok=True)
    rows = "".join(json.dumps(task_item_row(it, folder, data_source="text")) + "\n" for it in items)
    (folder / "text.jsonl").write_text(rows, encoding="utf-8")
    # Slack past the last update: relax at τ > 0 admits up to τ + 1 updates' prompts ahead of the trainer.
    order = prompt_schedule(len(items), hp["groups_per_step"], hp["updates"] + SCHEDULE_SLACK, hp["seed"])
    lines = rows.splitlines(keepends=True)
    (folder / "schedule.jsonl").write_text("".join(lines[i] for i in order), encoding="utf-8")
    to_prompt = PromptBuilder(ModelConfig(source=str(work / "model")))  # the folder's chat template and tokenizer
    hf = open_checkpoint(work / "model").tokenizer
    ids = [to_prompt(it).input_ids.tolist() for it in items]  # the ids relax feeds its model
    prompts = [hf.decode(x) for x in ids]
    assert [hf(p, add_special_tokens=False)["input_ids"] for p in prompts] == ids
    # TRL's side checks that its tokenizer gives these very ids (it once got 9 where relax fed 20: the checkpoint's
    # tokenizer was loaded as another class, see models/checkpoint.py).
    task = {
        "prompts": [prompts[i] for i in order],
        "answers": [items[i].answer for i in order],
        "prompt_ids": {prompts[i]: ids[i] for i in range(len(items))},
    }
    (work / "task.json").write_text(json.dumps(task), encoding="utf-8")


def _trl_python(work: Path) -> Path:
    """A throwaway venv with ``trl`` (and ``accelerate``) under ``work``, layered over this environment (a
    ``.pth`` file) so that TRL runs on the same torch and transformers as relax; never a project dependency."""
    venv = work / "trl-venv"
    python = venv / "bin" / "python"
    if not python.is_file():
        subprocess.run(["uv", "venv", "--quiet", "--python", sys.executable, str(venv)], check=True)
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # addsitedir (not a bare path line) so the base's own .pth files, the editable workspace packages, apply too
    base = [p for p in sys.path if p.endswith("site-packages")]
    lines = "".join(f"import site; site.addsitedir({p!r})\n" for p in base)
    (Path(site) / "_relax_base.pth").write_text(lines, encoding="utf-8")
    probe = subprocess.run([str(python), "-c", "import trl"], capture_output=True)
    if probe.returncode != 0:
        packages = [f"trl=={TRL_VERSION}", "accelerate"]  # everything else trl needs is in this environment
        subprocess.run(["uv", "pip", "install", "--quiet", "--python", str(python), "--no-deps", *packages], check=True)
    return python


def trl_side_script() -> Path:
    """:data:`TRL_SIDE_SCRIPT`, checked to exist (only a source checkout has it)."""
    if not TRL_SIDE_SCRIPT.is_file():
        raise FileNotFoundError(
            f"relax bench trl runs {TRL_SIDE_SCRIPT.name} from relax-services' benchmarks folder, which only a source "
            f"checkout has (not found at {TRL_SIDE_SCRIPT})"
        )
    return TRL_SIDE_SCRIPT


def _children_cpu_s() -> float:
    """User + system CPU seconds of this process's waited-for children, theirs included (``RUSAGE_CHILDREN``): a
    side's whole tree once it has exited, less any process orphaned before its exit (none in either side's normal
    shutdown)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(name: str, cmd: list[str], env: dict[str, str], log: Path) -> SideResult:
    """Launch ``cmd``, sample its tree's PSS until it exits, count its CPU seconds; the timeline is filled in by
    the caller."""
    side = SideResult(name=name, start=time.time())
    before = _children_cpu_s()
    with log.open("w", encoding="utf-8") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env)
        memory = PeakMemory(pid=proc.pid, interval_s=0.25).start()
        code = proc.wait()
        side.peak_bytes = memory.stop()
        side.peak_processes = memory.peak_processes
    side.wall_s = time.time() - side.start
    side.cpu_s = _children_cpu_s() - before
    if code != 0:
        raise RuntimeError(f"{name} exited with status {code}; see {log}")
    return side


def _run_trl(work: Path, hp: BenchHParams, env: dict[str, str], capture: Sequence[int] = ()) -> SideResult:
    python = _trl_python(work)
    out = work / "trl" / "timeline.jsonl"
    shutil.rmtree(out.parent, ignore_errors=True)
    out.parent.mkdir(parents=True)
    cmd = [str(python), str(trl_side_script()), "--work", str(work), "--out", str(out), "--hparams", json.dumps(hp)]
    if capture:
        cmd += ["--capture-steps", ",".join(map(str, capture)), "--capture-dir", str(out.parent / "captures")]
    side = _run(f"TRL {TRL_VERSION} GRPOTrainer", cmd, env, work / "trl" / "log.txt")
    for line in out.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        side.times.append(float(record["time"]))
        side.rewards.append(float(record["reward"]))
        side.samples = int(record["samples"])
    return side


def _side_name(mode: str, tau: int) -> str:
    return f"relax-{mode}-tau{tau}"


def relax_overrides(work: Path, hp: BenchHParams, tau: int, mode: str = "colocated") -> list[str]:
    """The ``relax train`` overrides of relax's side at ``tau`` in ``mode`` (one of :data:`RELAX_MODES`): the
    bench's hyper-parameters in relax's keys."""
    if mode not in RELAX_MODES:
        raise ValueError(f"relax side mode must be one of {RELAX_MODES}, got {mode!r}")
    name = _side_name(mode, tau)
    return [
        f"run.mode={mode}",
        f"run.output_dir={work}",
        f"run.name={name}",
        "run.progress=none",
        f"staleness.tau={tau}",
        f"model.source={work / 'model'}",
        f"data.train_files={work / 'data' / 'schedule.jsonl'}",
        "data.shuffle_buffer=1",  # the schedule's order, as TRL reads it
        f"data.eval_files={work / 'data' / 'text.jsonl'}",
        "data.adaptive_weights=false",
        f"data.seed={hp['seed']}",  # the prompt order follows the bench seed, as TRL's sampler does
        f"trainer.total_steps={hp['updates']}",
        f"trainer.groups_per_step={hp['groups_per_step']}",
        f"trainer.micro_batch_groups={hp['groups_per_step']}",
        "trainer.warmup_format_steps=0",
        "trainer.target_reward=null",
        "trainer.max_minutes=30",
        f"trainer.checkpoint_every={hp['updates']}",
        f"trainer.seed={hp['seed']}",
        f"rollout.groups_per_call={hp['groups_per_step']}",
        f"rollout.max_new_tokens={hp['max_new_tokens']}",
        f"rollout.temperature={hp['temperature']}",
        f"algorithm.group_size={hp['group_size']}",
        "algorithm.kl_coef=0.0",
        "algorithm.entropy_coef=0.0",
        f"algorithm.clip_eps_low={hp['clip_eps']}",
        f"algorithm.clip_eps_high={hp['clip_eps']}",
        "algorithm.loss_agg_mode=seq-mean-token-mean",
        "algorithm.norm_adv_by_std=true",
        f"optimizer.lr={hp['lr']}",
        "optimizer.schedule=constant",
        f"optimizer.grad_clip={hp['grad_clip']}",
        "eval.every_steps=100000",
    ]


def _run_relax(work: Path, hp: BenchHParams, tau: int, env: dict[str, str], mode: str = "colocated") -> SideResult:
    from relax_services.reporting.footprint import update_split
    from relax_services.reporting.metrics import read_metrics

    name = _side_name(mode, tau)
    overrides = relax_overrides(work, hp, tau, mode)
    cmd = [sys.executable, "-m", "relax_services.cli", "train", *overrides]
    shutil.rmtree(work / name, ignore_errors=True)  # a fresh run folder: metrics.jsonl appends
    side = _run(f"relax {mode} τ={tau}", cmd, env, work / f"{name}.log")
    metrics = work / name / "metrics.jsonl"
    for record in read_metrics(metrics, "train"):
        side.times.append(float(record["time"]))
        side.rewards.append(float(record["reward"]))
        side.samples = int(record["samples"])
    side.split = update_split(metrics)
    return side


def _bench_one(
    work: Path,
    updates: int,
    sides_wanted: Sequence[tuple[str, int]],
    seed: int,
    settings: BenchSettings,
) -> list[SideResult]:
    """One seed: write the model and task, run TRL then each relax side (``(mode, τ)``), save the table
    (``work/results.md``)."""
    work.mkdir(parents=True, exist_ok=True)
    _write_model(work, seed)
    hp = _hparams(updates, seed, work, settings)
    _write_task(work, hp)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    print(
        f"relax bench trl: seed {seed}, {updates} updates per side, {hp['groups_per_step']}×{hp['group_size']} "
        f"samples per update, lr {hp['lr']:g}, in {work}",
        flush=True,
    )
    sides = [_run_trl(work, hp, env)]
    print(f"  {sides[-1].name}: done in {sides[-1].wall_s:.0f}s", flush=True)
    for mode, tau in sides_wanted:
        sides.append(_run_relax(work, hp, tau, env, mode))
        print(f"  {sides[-1].name}: done in {sides[-1].wall_s:.0f}s", flush=True)
    table = format_table(sides)
    (work / "results.md").write_text(table + "\n", encoding="utf-8")
    raw = {s.name: {"figures": summarise(s), "side": dataclasses.asdict(s)} for s in sides}  # re-derivable
    (work / "results.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
    print(table, flush=True)
    return sides


def run_trl_bench(
    work: Path,
    updates: int = 400,
    taus: Sequence[int] = (0, 2),
    seed: int = 0,
    seeds: Sequence[int] = (),
    distributed_taus: Sequence[int] = (2,),
    settings: BenchSettings | None = None,
) -> int:
    """Run the bench at ``seed`` in ``work``: TRL, then relax colocated at each of ``taus`` and distributed at
    each of ``distributed_taus``; with ``seeds``, once per seed in ``work/seed-<n>``, then print and save the
    per-seed updates to each threshold with their medians (``work/spread.md``): the initial weights, the prompt
    order and the samples all follow the seed, and one seed is not a measurement of sample efficiency."""
    work = work.resolve()
    settings = settings or BenchSettings()
    wanted = [("colocated", t) for t in taus] + [("distributed", t) for t in distributed_taus]
    if not seeds:
        _bench_one(work, updates, wanted, seed, settings)
        return 0
    by_seed = {s: _bench_one(work / f"seed-{s}", updates, wanted, s, settings) for s in seeds}
    spread = format_spread(by_seed)
    (work / "spread.md").write_text(spread + "\n", encoding="utf-8")
    print(spread, flush=True)
    return 0


def check_updates(work: Path, steps: Sequence[int], seed: int = 0, settings: BenchSettings | None = None) -> int:
    """The same-batch, same-state check: TRL trains to the last of ``steps`` (0-based updates) saving each of them
    at its boundary, then relax's trainer step replays each from TRL's weights and Adam state
    (:mod:`relax_services.bench.trl_replay`). Prints the table and saves it as ``work/update_check.md``.

    Returns:
        0 when every update matches TRL's (:attr:`~relax_services.bench.trl_replay.UpdateCheck.matches`), else 1.
    """
    import torch

    from relax_services.bench.trl_replay import format_checks, replay_update
    from relax_services.config import load_run_config

    if not steps or min(steps) < 0:
        raise ValueError(f"check_updates needs 0-based update indices >= 0, got {list(steps)}")
    chosen = sorted(set(steps))
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    _write_model(work, seed)
    hp = _hparams(chosen[-1] + 1, seed, work, settings)
    _write_task(work, hp)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    print(f"relax bench trl --check-updates: seed {seed}, TRL to update {chosen[-1]}, in {work}", flush=True)
    _run_trl(work, hp, env, capture=chosen)
    cfg = load_run_config(None, relax_overrides(work, hp, 0))
    folder = work / "trl" / "captures"
    checks = [replay_update(torch.load(folder / f"step{s:04d}.pt", weights_only=False), cfg) for s in chosen]
    table = format_checks(checks)
    (work / "update_check.md").write_text(table + "\n", encoding="utf-8")
    print(table, flush=True)
    return 0 if all(c.matches for c in checks) else 1

"""``relax bench trl --config YAML``: TRL's ``GRPOTrainer`` against relax colocated and distributed on a user's run
config (the YAML ``relax train`` takes): its checkpoint folder (``model.source``, or ``--model``), its data
(``data.train_files`` / ``data.eval_files``) and its reward (``reward``), one side after the other, each for the
config's number of updates (``trainer.total_steps``) or the same wall-clock budget (``--minutes``), whichever ends
first.

Held equal, read from the config: the checkpoint folder (TRL loads it with ``AutoModelForCausalLM`` and
``AutoTokenizer``, its own tokenizer and chat template; both in float32 on the CPU), the prompts and their order
(relax's own data path renders them: :func:`write_config_task` draws the training rows from relax's training stream
with the config's shuffle and seed, writes them as ``data/schedule.jsonl``, which relax reads unshuffled, and sends
TRL the same rows as text that its tokenizer must turn into the very ids relax feeds, or TRL's side stops), the
reward (relax-core's reward runner built from the config's ``reward`` on both sides), group size, prompts per
update, micro-batch (TRL: per-device batch × gradient accumulation), max new tokens, temperature, learning rate,
schedule (constant only), AdamW's betas, ε and weight decay, gradient clip, clip ε low and high, β (``kl_coef``,
k3 on both sides), loss aggregation, group-std advantage scaling, the ids never sampled, the seed and torch's
intra-op threads (``run.threads``; unset, what the launch would resolve for the distributed run on this machine).
The relax sides run at the config's τ.

Not held equal, and printed with the table (:func:`differences`): anything the config sets that TRL has no
counterpart for (an entropy bonus, the decoupled proximal pass, a learning-rate schedule other than constant).

The held-out reward: relax's Evaluator's final figure (greedy decoding, the mean over the eval tasks); TRL's final
weights are scored by a plain greedy ``generate`` over the same eval rows (relax's prompt ids, the same max new
tokens and reward runner), mean over the eval tasks likewise.

Memory: each side's peak PSS of its process tree and, at that peak, per process; beside it an estimate of where
it goes: the weights (parameters × 4 bytes, float32), AdamW's two moments (2 × parameters × 4 bytes) and the rest
(activations, runtime, copies, the object store) = peak − those.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from relax_services.bench.trl import RELAX_MODES, SCHEDULE_SLACK, TRL_VERSION, _run, _trl_python, trl_side_script
from relax_services.bench.trl_figures import SideResult, format_config_table, memory_estimate

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from relax_services.config import RunConfig
    from relax_services.data.prompts import PromptBuilder
    from relax_services.rows import DataItem

__all__ = [
    "ConfigHParams",
    "config_hparams",
    "config_overrides",
    "differences",
    "run_config_bench",
    "write_config_task",
]

_TRL_LOSS = {"seq-mean-token-mean": "grpo", "token-mean": "dapo", "seq-mean-token-sum-norm": "dr_grpo"}
"""relax's ``algorithm.loss_agg_mode`` → TRL's ``loss_type`` of the same aggregation."""

_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


class ConfigHParams(TypedDict):
    """What both sides train with, read from the run config (sent to TRL's side as JSON)."""

    task: str  # "config": TRL's side reads task.json's rows and scores with relax-core's reward runner
    updates: int
    minutes: float | None
    seed: int
    group_size: int
    groups_per_step: int
    micro_batch_groups: int
    max_new_tokens: int
    temperature: float
    lr: float
    betas: list[float]
    adam_eps: float
    weight_decay: float
    grad_clip: float | None
    clip_eps: float
    clip_eps_high: float
    beta: float
    loss_type: str
    scale_rewards: str
    suppressed_ids: list[int]
    intra_op_threads: int
    gradient_checkpointing: bool  # trainer.activation_checkpointing (both recompute whole layers)
    reward: dict[str, object]  # relax-core's RewardRunnerConfig, as JSON


def _threads(cfg: RunConfig) -> int:
    """``run.threads``, or what the launch resolves for the distributed run on this machine's cores."""
    from relax_services.config.threads import threads_of, with_threads

    distributed = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": "distributed"})})
    return threads_of(with_threads(distributed, os.cpu_count() or 1))


def config_hparams(cfg: RunConfig, minutes: float | None = None) -> ConfigHParams:
    """The shared settings of ``cfg`` (model, data and reward resolved; ``minutes`` the wall-clock budget per side,
    None: the config's number of updates only).

    Raises:
        ValueError: For a loss aggregation TRL has no counterpart for.
    """
    from relax_services.models import open_checkpoint

    algo, opt, trainer = cfg.algorithm, cfg.optimizer, cfg.trainer
    if algo.loss_agg_mode not in _TRL_LOSS:
        raise ValueError(
            f"algorithm.loss_agg_mode={algo.loss_agg_mode!r} has no TRL loss_type; use one of {sorted(_TRL_LOSS)}"
        )
    return {
        "task": "config",
        "updates": trainer.total_steps,
        "minutes": minutes,
        "seed": trainer.seed,
        "group_size": algo.group_size,
        "groups_per_step": trainer.groups_per_step,
        "micro_batch_groups": min(trainer.micro_batch_groups, trainer.groups_per_step),  # divides groups_per_step
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "temperature": cfg.rollout.temperature,
        "lr": opt.lr,
        "betas": list(opt.betas),
        "adam_eps": opt.eps,
        "weight_decay": opt.weight_decay,
        "grad_clip": opt.grad_clip,
        "clip_eps": algo.clip_eps_low,
        "clip_eps_high": algo.clip_eps_high,
        "beta": algo.kl_coef,
        "loss_type": _TRL_LOSS[algo.loss_agg_mode],
        "scale_rewards": "group" if algo.norm_adv_by_std else "none",
        "suppressed_ids": list(open_checkpoint(cfg.model.source).tokens.never_sample),
        "intra_op_threads": _threads(cfg),
        "gradient_checkpointing": trainer.activation_checkpointing,
        "reward": cfg.reward.runner_config().model_dump(mode="json"),
    }


def differences(cfg: RunConfig) -> list[str]:
    """What the config sets that TRL's side cannot hold equal (printed under the table)."""
    algo, opt = cfg.algorithm, cfg.optimizer
    out = []
    if algo.entropy_coef:
        out.append(f"relax adds an entropy bonus (algorithm.entropy_coef={algo.entropy_coef:g}); TRL has none")
    if algo.decoupled and cfg.staleness.tau != 0:
        out.append("relax computes decoupled PPO's proximal log-probs (algorithm.decoupled); TRL at τ = 0 needs none")
    if opt.schedule != "constant" or opt.warmup_steps:
        out.append(f"relax's lr schedule is {opt.schedule} with {opt.warmup_steps} warm-up steps; TRL's is constant")
    if algo.kl_coef and algo.kl_estimator != "k3":
        out.append(f"relax's KL estimator is {algo.kl_estimator}; TRL's is k3")
    return out


def _schedule(cfg: RunConfig, count: int) -> tuple[list[str], list[DataItem]]:
    """The first ``count`` training rows of relax's training stream (the config's files, shuffle and seed): the
    JSONL lines they were read from, and their feeder items."""
    from relax_services.data.files import train_stream

    stream = train_stream(cfg.data)
    files: dict[str, list[str]] = {}
    lines, items = [], []
    for _ in range(count):
        item = stream.next()
        record = item["item"]
        source = Path(record.source)
        if source.suffix != ".jsonl":
            raise ValueError(f"relax bench trl --config reads JSONL training files, got {source}")
        if record.source not in files:
            files[record.source] = source.read_text(encoding="utf-8").splitlines()
        lines.append(files[record.source][record.row] + "\n")
        items.append(item)
    return lines, items


def write_config_task(cfg: RunConfig, work: Path, hp: ConfigHParams) -> None:
    """Both sides' prompts in one order: ``work/data/schedule.jsonl`` (relax's training rows in its stream's order,
    for relax to read unshuffled) and ``work/task.json`` (the same rows as TRL's prompt text, with the ids relax
    renders for them and their reward inputs; the held-out rows likewise).

    Raises:
        ValueError: When a prompt's ids do not survive decoding and re-encoding by the checkpoint's tokenizer (TRL
            would feed other ids than relax), or a training file is not JSONL.
    """
    from relax_services.data.files import eval_stream, record_item
    from relax_services.data.run_data import PromptBuilder
    from relax_services.models import open_checkpoint

    lines, items = _schedule(cfg, (hp["updates"] + SCHEDULE_SLACK) * hp["groups_per_step"])
    folder = work / "data"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "schedule.jsonl").write_text("".join(lines), encoding="utf-8")
    held = [record_item(r) for r in eval_stream(cfg.data)] if cfg.data.eval_files else []
    to_prompt = PromptBuilder(cfg.model)
    hf = open_checkpoint(cfg.model.source).tokenizer
    task = {"train": _task_rows(items, to_prompt, hf), "eval": _task_rows(held, to_prompt, hf)}
    (work / "task.json").write_text(json.dumps(task), encoding="utf-8")


def _task_rows(items: list[DataItem], to_prompt: PromptBuilder, hf: PreTrainedTokenizerBase) -> list[dict[str, object]]:
    """TRL's rows of feeder ``items``: prompt text, relax's prompt ids, and what the reward runner takes."""
    from relax_services.rows import reward_request

    out: list[dict[str, object]] = []
    for item in items:
        ids = to_prompt(item).input_ids.tolist()  # [P] the ids relax feeds its model
        text = hf.decode(ids)
        if hf(text, add_special_tokens=False)["input_ids"] != ids:
            raise ValueError(f"prompt {item['id']}: its ids do not survive the tokenizer's decode and encode")
        request = reward_request("", item)
        out.append(
            {
                "prompt": text,
                "ids": ids,
                "ground_truth": request.ground_truth,
                "data_source": request.data_source,
                "extra_info": dict(request.metadata),
            }
        )
    return out


def config_overrides(work: Path, cfg: RunConfig, hp: ConfigHParams, mode: str) -> list[str]:
    """The ``relax train CONFIG`` overrides of relax's side in ``mode`` (one of :data:`RELAX_MODES`): the shared
    settings in relax's keys, at the config's τ."""
    if mode not in RELAX_MODES:
        raise ValueError(f"relax side mode must be one of {RELAX_MODES}, got {mode!r}")
    out = [
        f"run.mode={mode}",
        f"run.output_dir={work}",
        f"run.name=relax-{mode}",
        "run.progress=none",
        f"run.threads={hp['intra_op_threads']}",
        f"model.source={cfg.model.source}",
        f"data.train_files={work / 'data' / 'schedule.jsonl'}",
        "data.shuffle_buffer=1",  # the schedule's order, as TRL reads it
        f"trainer.total_steps={hp['updates']}",
        "trainer.target_reward=null",  # both sides run their full budget
    ]
    if hp["minutes"] is not None:
        out.append(f"trainer.max_minutes={hp['minutes']}")
    return out


def _run_trl_config(work: Path, hp: ConfigHParams, model: str, env: dict[str, str]) -> SideResult:
    python = _trl_python(work)
    out = work / "trl" / "timeline.jsonl"
    shutil.rmtree(out.parent, ignore_errors=True)
    out.parent.mkdir(parents=True)
    cmd = [str(python), str(trl_side_script()), "--work", str(work), "--out", str(out), "--hparams", json.dumps(hp)]
    cmd += ["--model", model]
    side = _run(f"TRL {TRL_VERSION}", cmd, env, work / "trl" / "log.txt")
    side.peak_processes = {("trl_side.py" if k == "driver" else k): v for k, v in side.peak_processes.items()}
    for line in out.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "heldout_reward" in record:
            side.heldout_reward = float(record["heldout_reward"])
            continue
        side.times.append(float(record["time"]))
        side.rewards.append(float(record["reward"]))
        side.samples = int(record["samples"])
    return side


def _run_relax_config(
    config: Path, work: Path, cfg: RunConfig, hp: ConfigHParams, mode: str, extra: list[str], env: dict[str, str]
) -> SideResult:
    from relax_services.reporting.footprint import update_split
    from relax_services.reporting.metrics import read_metrics

    name = f"relax-{mode}"
    overrides = [*extra, *config_overrides(work, cfg, hp, mode)]
    cmd = [sys.executable, "-m", "relax_services.cli", "train", str(config), *overrides]
    shutil.rmtree(work / name, ignore_errors=True)
    side = _run(f"relax {mode} τ={cfg.staleness.tau}", cmd, env, work / f"{name}.log")
    metrics = work / name / "metrics.jsonl"
    for record in read_metrics(metrics, "train"):
        side.times.append(float(record["time"]))
        side.rewards.append(float(record["reward"]))
        side.samples = int(record["samples"])
    for record in read_metrics(metrics, "eval"):
        rewards = record["reward"]  # per eval task
        mean = statistics.fmean(rewards.values()) if isinstance(rewards, dict) else float(rewards)
        side.heldout_curve.append((float(record["wall"]), mean))
        if record.get("final"):
            side.heldout_reward = mean
    side.split = update_split(metrics)
    return side


def run_config_bench(
    config: Path,
    work: Path,
    model: Path | None = None,
    minutes: float | None = None,
    modes: tuple[str, ...] = RELAX_MODES,
    overrides: tuple[str, ...] = (),
) -> int:
    """Run TRL, then relax in each of ``modes``, on the run config ``config`` (``model`` replaces its
    ``model.source``, ``overrides`` are ``relax train``'s dotted overrides), each side for the config's updates
    or ``minutes`` of wall-clock; print and save the table (``work/results.md``, raw figures in
    ``work/results.json``)."""
    from relax_services.config import load_run_config

    if unknown := [m for m in modes if m not in RELAX_MODES]:
        raise ValueError(f"relax side modes must be among {RELAX_MODES}, got {unknown}")
    work = work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    extra = [*overrides, *([f"model.source={model.resolve()}"] if model is not None else [])]
    cfg = load_run_config(config, extra)
    cfg = cfg.model_copy(
        update={"model": cfg.model.model_copy(update={"source": str(Path(cfg.model.source).resolve())})}
    )
    hp = config_hparams(cfg, minutes)
    write_config_task(cfg, work, hp)
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    budget = f"{hp['updates']} updates" + (f" or {minutes:g} min" if minutes is not None else "")
    print(
        f"relax bench trl --config {config}: {cfg.model.source}, {budget} per side, {hp['groups_per_step']}×"
        f"{hp['group_size']} samples per update, {hp['intra_op_threads']} intra-op thread(s), in {work}",
        flush=True,
    )
    sides = [_run_trl_config(work, hp, cfg.model.source, env)]
    print(f"  {sides[-1].name}: done in {sides[-1].wall_s:.0f}s", flush=True)
    for mode in modes:
        sides.append(_run_relax_config(config, work, cfg, hp, mode, extra, env))
        print(f"  {sides[-1].name}: done in {sides[-1].wall_s:.0f}s", flush=True)
    table = format_config_table(sides, memory_estimate(Path(cfg.model.source)), differences(cfg))
    (work / "results.md").write_text(table + "\n", encoding="utf-8")
    raw = {s.name: dataclasses.asdict(s) for s in sides}
    (work / "results.json").write_text(json.dumps({"hparams": hp, "sides": raw}, indent=1), encoding="utf-8")
    print(table, flush=True)
    return 0

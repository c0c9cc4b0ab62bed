"""The ``relax`` command line: ``relax train``, ``relax export``, ``relax bench pipeline``, ``relax bench train``,
``relax bench parallel``, ``relax plan``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.control.controller import Controller

__all__ = ["main"]

_STARTED = time.monotonic()  # the command's start: the run summary's start-up phases count from here


class _StartupSignals:
    """SIGINT/SIGTERM handling from the first line of a command: a signal that arrives while the heavy imports or
    Ray start is recorded (the default action would abort mid-import with a core dump) and handed to the
    controller once it exists, which stops the run at its next chance and checkpoints."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.target: Any = None  # the controller, once built
        self._previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in self._previous:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.reason = self.reason or f"signal {signal.Signals(signum).name}"
        if self.target is not None:
            self.target.request_stop(self.reason)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


_MEMORY_HINT = (
    "Ray's memory monitor killed a service: this machine's memory use (every process on it counts, not only "
    "this run's) passed Ray's threshold (RAY_memory_usage_threshold, default 0.95). Free memory, or raise the "
    "threshold; RAY_memory_monitor_refresh_ms=0 turns the monitor off. The run folder keeps its last checkpoint: "
    "continue with --resume."
)


def _train(args: argparse.Namespace) -> int:
    signals = _StartupSignals()  # first: a signal during the imports below must not abort with a core dump
    try:
        return _train_guarded(args, signals)
    finally:
        signals.restore()


def _train_guarded(args: argparse.Namespace, signals: _StartupSignals) -> int:
    # Only light modules before the config is checked: a config error is reported in about a second.
    from relax_core import ConfigError
    from relax_services.config import load_run_config
    from relax_services.config.resume import resume_config
    from relax_services.control.preflight import check_run, make_run_dir

    overrides = list(args.overrides)
    if args.ray_address is not None:
        overrides.append(f"run.ray_address={args.ray_address}")
    changed: dict[str, tuple[Any, Any]] = {}
    try:
        cfg = load_run_config(args.config, overrides)
        run_dir = check_run(cfg, resume=args.resume)
        if args.resume:
            cfg, changed = resume_config(run_dir, args.config, overrides)
            run_dir = check_run(cfg, resume=True)
    except ConfigError as exc:
        print(f"relax train: {exc}", file=sys.stderr)
        return 2
    from relax_services.models._light import CheckpointError
    from relax_services.models.source_check import check_source, linear_layer_names

    if cfg.run.mode == "colocated":  # this process imports the model stack next: as every Ray worker does first
        from relax_services.hosting.worker_setup import keep_triton_out

        keep_triton_out()

    in_process = cfg.run.mode == "colocated"
    try:  # the model folder's contents (architecture, sizes, tokenizer) before a run folder, Ray or any service
        # Distributed: in a child process, as this one never imports the model stack; colocated: here, where the
        # services import it anyway. With model.lora the same check also reads the model's linear layer names.
        if cfg.model.lora is None:
            folder: Path | None = check_source(cfg.model.source, cfg.model.seed, in_process=in_process)
        else:
            folder = None  # LoRA is refused with sequence parallelism: no heads to check
            names = linear_layer_names(cfg.model.source, cfg.model.seed, in_process=in_process)
            if unknown := [t for t in cfg.model.lora.target_modules if t not in names]:
                print(
                    f"relax train: model.lora.target_modules: {unknown} name no linear layer of the model; its "
                    f"linear layers are named {names}",
                    file=sys.stderr,
                )
                return 2
    except CheckpointError as exc:
        print(f"relax train: model.source: {exc}", file=sys.stderr)
        return 2
    if folder is not None and (folder / "config.json").is_file():
        import json

        from relax_services.config.trainer_group import check_sequence_parallel_heads

        try:  # the mesh against the model's heads, before anything starts
            check_sequence_parallel_heads(cfg, json.loads((folder / "config.json").read_text(encoding="utf-8")))
        except ValueError as exc:
            print(f"relax train: {exc}", file=sys.stderr)
            return 2
    from relax_services.data.files import check_data

    try:  # dataset files and reward functions likewise: a missing file or column fails here, naming it
        check_data(cfg)
    except ValueError as exc:  # DataFileError is one
        print(f"relax train: {exc}", file=sys.stderr)
        return 2
    from relax_services.control.auto_layout import layout_text, plan_layout

    try:  # trainer.layout=auto: the planner's mesh becomes the config's degrees before anything uses them
        cfg, auto_plan = plan_layout(cfg, folder) if folder is not None else (cfg, None)
    except ValueError as exc:
        print(f"relax train: trainer.layout=auto: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:  # where every process would go; nothing loaded, no run folder, no service
        from relax_services.control.dry_run import dry_run
        from relax_services.control.launch import LaunchError

        try:
            print(layout_text(cfg, auto_plan), flush=True)  # the Trainer's mesh, as the run would realise it
            print(dry_run(cfg), flush=True)
        except LaunchError as exc:
            print(f"relax train: {exc}", file=sys.stderr)
            return 2
        return 0
    try:
        run_dir = make_run_dir(cfg, run_dir)
    except ConfigError as exc:
        print(f"relax train: {exc}", file=sys.stderr)
        return 2
    print(f"relax train: run folder {run_dir}", flush=True)
    for key, (old, new) in changed.items():
        print(f"relax train: resumed with {key}={new!r} (the saved run had {old!r})", flush=True)
    from relax_services.control.launch import LaunchError, launch  # ray (the model stack only in the services)
    from relax_services.faults.health import memory_kill
    from relax_services.reporting.footprint import PeakMemory, format_footprint, update_split
    from relax_services.reporting.summary import format_summary

    if signals.reason is not None:  # arrived during the imports: stop before Ray starts
        print(
            f"relax train: {signals.reason} before the run started; nothing was run "
            f"(the folder {run_dir} holds no checkpoint)",
            file=sys.stderr,
        )
        return 1

    def on_start(controller: Controller) -> None:
        signals.target = controller
        if signals.reason is not None:
            controller.request_stop(signals.reason)

    plan_texts: list[str] = []

    def on_resolved(resolved: RunConfig) -> None:
        plan_text = layout_text(resolved, auto_plan)  # the Trainer service records what its engine realised beside it
        plan_texts.append(plan_text)
        print(plan_text, flush=True)
        try:
            (run_dir / "plan.txt").write_text(plan_text + "\n", encoding="utf-8")
        except OSError as exc:
            print(f"relax train: plan.txt not written: {exc}", file=sys.stderr)

    memory = PeakMemory().start()
    try:
        result = launch(
            cfg,
            run_dir,
            resume=args.resume,
            resume_changes=changed,
            started_at=_STARTED,
            on_start=on_start,
            on_resolved=on_resolved,
        )
    except LaunchError as exc:
        memory.stop()
        print(f"relax train: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if memory_kill(exc):
            print(f"relax train: {_MEMORY_HINT}\n  ({type(exc).__name__}: {str(exc).splitlines()[0]})", file=sys.stderr)
            return 1
        raise
    memory.stop()
    text = (
        format_summary(result)
        + "\n"
        + format_footprint(update_split(run_dir / "metrics.jsonl"), memory.peak_bytes, memory.peak_processes)
        + "".join(f"\n{plan}" for plan in plan_texts[-1:])  # the plan the run started with, as it printed it
    )
    try:
        (run_dir / "summary.txt").write_text(text + "\n", encoding="utf-8")
    except OSError as exc:  # e.g. the disk that stopped the run: the summary still reaches the terminal
        print(f"relax train: summary.txt not written: {exc}", file=sys.stderr)
    print(text, flush=True)
    if result.error:
        print(f"relax train: {result.error}", file=sys.stderr)
        return 1
    return 0


def _export(args: argparse.Namespace) -> int:
    from relax_services.control.export import export_run

    try:
        out = export_run(args.run_dir, args.out_dir, args.step)
    except (FileNotFoundError, ValueError) as exc:
        print(f"relax export: {exc}", file=sys.stderr)
        return 2
    print(f"relax export: wrote {out}", flush=True)
    return 0


def _scale(args: argparse.Namespace) -> int:
    from relax_services.control.endpoint import EndpointError, send_request

    role, sep, text = args.change.partition("=")
    if not sep or role != "rollout":
        print(f"relax scale: expected rollout=N (the rollout replicas to run), got {args.change!r}", file=sys.stderr)
        return 2
    try:
        count = int(text)
    except ValueError:
        print(f"relax scale: rollout={text!r}: the count is a whole number", file=sys.stderr)
        return 2
    if count < 1:
        print(f"relax scale: rollout={count}: a run keeps at least 1 rollout replica", file=sys.stderr)
        return 2
    mode = _run_mode(args.run_dir)
    if mode == "colocated":
        print(
            f"relax scale: the run in {args.run_dir} is in colocated mode (every service a thread of one process): "
            "its rollout cannot scale; run with run.mode=distributed",
            file=sys.stderr,
        )
        return 2
    try:
        answer = send_request(args.run_dir, {"op": "scale", "role": "rollout", "count": count})
    except EndpointError as exc:
        print(f"relax scale: {exc}", file=sys.stderr)
        return 2
    changes = [
        f"{what} {', '.join(map(str, names))}" for what in ("added", "removed") if (names := _listed(answer[what]))
    ]
    done = "; ".join(changes) or "no change"
    print(f"relax scale: rollout {answer['from']} -> {answer['to']} in {answer['seconds']} s ({done})", flush=True)
    return 0


def _listed(value: object) -> list[object]:
    """A JSON answer's list (empty for anything else)."""
    return list(value) if isinstance(value, list) else []


def _run_mode(run_dir: Path) -> str | None:
    """``run.mode`` of the run in ``run_dir`` as its saved ``config.yaml`` says (None: no readable config)."""
    import yaml

    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    run = saved.get("run") if isinstance(saved, dict) else None
    mode = run.get("mode") if isinstance(run, dict) else None
    return mode if isinstance(mode, str) else None


def _view(args: argparse.Namespace) -> int:
    from relax_services.reporting.viewer import write_report

    try:
        out = write_report(args.run_dir)
    except FileNotFoundError as exc:
        print(f"relax view: {exc}", file=sys.stderr)
        return 2
    print(f"relax view: wrote {out}", flush=True)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from relax_services.bench.pipeline import run_pipeline_bench

    return run_pipeline_bench(args.taus, args.overrides, args.config)


def _bench_replicas(args: argparse.Namespace) -> int:
    from relax_services.bench.replicas import run_replica_bench

    return run_replica_bench(args.counts, args.overrides, args.config, live=args.live)


def _bench_train(args: argparse.Namespace) -> int:
    from relax_services.bench.train import run

    run(args)
    return 0


def _bench_parallel(args: argparse.Namespace) -> int:
    from relax_services.bench.parallel import run

    run(args)
    return 0


def _bench_trl(args: argparse.Namespace) -> int:
    from relax_services.bench.trl import BenchSettings, run_trl_bench

    def ints(text: str) -> list[int]:
        return [int(t) for t in text.split(",")] if text else []

    if args.config is not None:
        from relax_services.bench.trl_config import run_config_bench

        def names(text: str) -> list[str]:
            return [t for t in text.split(",") if t]

        return run_config_bench(
            args.config, args.work, args.model, args.minutes, tuple(names(args.modes)), tuple(args.overrides)
        )
    if args.model is not None or args.minutes is not None or args.overrides:
        print("relax bench trl: --model, --minutes and overrides need --config", file=sys.stderr)
        return 2
    settings = BenchSettings(lr=args.lr, group_size=args.group_size, groups_per_step=args.groups_per_step)
    if args.check_updates:
        from relax_services.bench.trl import check_updates

        return check_updates(args.work, ints(args.check_updates), seed=args.seed, settings=settings)
    return run_trl_bench(
        args.work,
        args.updates,
        ints(args.taus),
        seed=args.seed,
        seeds=ints(args.seeds),
        distributed_taus=ints(args.distributed_taus),
        settings=settings,
    )


def _chaos(args: argparse.Namespace) -> int:
    from relax_services.bench.chaos import run_chaos

    return run_chaos(args.config, args.overrides, args.faults, args.seed, args.actor_faults, args.eval_faults)


def _plan(args: argparse.Namespace) -> int:
    """``relax plan [CONFIG] [overrides]``: the Trainer plan the run with that config realises (the text
    ``relax train`` prints and the Trainer group reads back from its mesh); ``relax plan --model ...``: the
    cluster planner (``relax-plan``)."""
    rest = list(args.rest)
    if rest and rest[0].startswith("-"):
        from relax_parallel.cli import main as plan_main

        return int(plan_main(rest))
    from relax_core import ConfigError
    from relax_services.config import load_run_config
    from relax_services.engines.trainer_plan import trainer_plan_text

    config = rest.pop(0) if rest and "=" not in rest[0] else None
    try:
        cfg = load_run_config(config, rest)
    except ConfigError as exc:
        print(f"relax plan: {exc}", file=sys.stderr)
        return 2
    if cfg.trainer.layout != "auto":
        print(trainer_plan_text(cfg), flush=True)
        return 0
    from relax_services.control.auto_layout import layout_text, plan_layout
    from relax_services.models.source_check import check_source

    try:  # the planner reads the model's config and the first training rows, as relax train does
        cfg, plan = plan_layout(cfg, check_source(cfg.model.source, cfg.model.seed))
    except ValueError as exc:  # a CheckpointError is one
        print(f"relax plan: trainer.layout=auto: {exc}", file=sys.stderr)
        return 2
    print(layout_text(cfg, plan), flush=True)
    return 0


def _count(text: str) -> int:
    """An argparse type: an integer >= 0 (argparse turns the ValueError into a usage error)."""
    value = int(text)
    if value < 0:
        raise ValueError(text)
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``relax`` command's argument parser (train, export, view, scale, bench, chaos, plan)."""
    parser = argparse.ArgumentParser(prog="relax", description="Asynchronous RL post-training for omni-modal models.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser(
        "train",
        help="train a policy (no arguments: async GRPO, τ = 2, tiny omni model, synthetic omni tasks)",
        description="Run RL training. CONFIG is a YAML run config; overrides look like staleness.tau=1.",
    )
    train.add_argument("config", nargs="?", type=Path, default=None, help="YAML run config (default: embedded)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=50")
    train.add_argument("--ray-address", default=None, help="join an existing Ray cluster instead of starting one")
    train.add_argument("--resume", action="store_true", help="resume from the run folder's last checkpoint")
    train.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the config and the cluster and print where every role goes (node, GPU ids, dtype, memory "
        "estimate); loads no model and starts no service",
    )
    train.set_defaults(func=_train)
    export = sub.add_parser(
        "export",
        help="write a run checkpoint's policy as a Hugging Face folder",
        description="Export checkpoint STEP (default: the newest) of RUN_DIR to OUT_DIR in Hugging Face format.",
    )
    export.add_argument("run_dir", type=Path, help="a run folder written by relax train")
    export.add_argument("out_dir", type=Path, help="folder to write (replaced when it exists)")
    export.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest complete one)")
    export.set_defaults(func=_export)
    view = sub.add_parser(
        "view",
        help="write RUN_DIR/report.html: the run's plots, summary and evaluation samples in one static page",
        description="Write RUN_DIR/report.html, one HTML file that opens without a server: the run's plots, its "
        "summary and every evaluation's samples, filterable by task and step (report.html?task=T&step=N).",
    )
    view.add_argument("run_dir", type=Path, help="a run folder written by relax train")
    view.set_defaults(func=_view)
    scale = sub.add_parser(
        "scale",
        help="change the rollout replicas of a running run (relax scale RUN_DIR rollout=N)",
        description="Ask the driver of the run in RUN_DIR to run N rollout replicas: added ones join once they hold "
        "the trainer's weights, removed ones drain first. Only the run's owner can reach its driver.",
    )
    scale.add_argument("run_dir", type=Path, help="the folder of a running relax train")
    scale.add_argument("change", help="rollout=N (N >= 1)")
    scale.set_defaults(func=_scale)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    pipe = bench_sub.add_parser("pipeline", help="the same task and seeds at τ = 0 and τ > 0, side by side")
    pipe.add_argument("config", nargs="?", type=Path, default=None)
    pipe.add_argument("overrides", nargs="*")
    pipe.add_argument("--taus", default="0,1,2,4", help="comma-separated τ values (default 0,1,2,4)")
    pipe.set_defaults(func=_bench)
    replicas = bench_sub.add_parser("replicas", help="the same run with 1, 2, 3 rollout replicas, side by side")
    replicas.add_argument("config", nargs="?", type=Path, default=None)
    replicas.add_argument("overrides", nargs="*")
    replicas.add_argument("--counts", default="1,2,3", help="comma-separated replica counts (default 1,2,3)")
    replicas.add_argument(
        "--live", action="store_true", help="then one run scaled 1 → 2 → 1 live: join, first sample, drain, rates"
    )
    replicas.set_defaults(func=_bench_replicas)
    bench_train = bench_sub.add_parser("train", help="FSDP2 engine: updates/s at world size 1 and 2, sync GB/s")
    from relax_services.bench.train import add_arguments  # light: the workers import the models lazily

    add_arguments(bench_train)
    bench_train.set_defaults(func=_bench_train)
    bench_parallel = bench_sub.add_parser(
        "parallel", help="Trainer layouts (dp 2, sp 2, tp 2): peak memory and s/update against relax-parallel's"
    )
    from relax_services.bench.parallel import add_arguments as parallel_arguments  # light: stdlib at import

    parallel_arguments(bench_parallel)
    bench_parallel.set_defaults(func=_bench_parallel)

    from relax_services.bench.trl import BenchSettings  # light: stdlib and the footprint module

    defaults = BenchSettings()
    trl = bench_sub.add_parser(
        "trl", help="TRL's GRPOTrainer against relax colocated (τ = 0, 2) and distributed (τ = 2) on one task"
    )
    trl.add_argument("--work", type=Path, default=Path("/tmp/relax-bench-trl"), help="venv, data and runs")
    trl.add_argument("--updates", type=int, default=400, help="updates per side (default 400)")
    trl.add_argument("--taus", default="0,2", help="relax colocated's τ values (default 0,2; empty: none)")
    trl.add_argument("--distributed-taus", default="2", help="relax distributed's τ values (default 2; empty: none)")
    trl.add_argument("--lr", type=float, default=defaults.lr, help=f"both sides' learning rate ({defaults.lr:g})")
    trl.add_argument("--group-size", type=int, default=defaults.group_size, help="completions per prompt")
    trl.add_argument("--groups-per-step", type=int, default=defaults.groups_per_step, help="prompts per update (of 25)")
    trl.add_argument("--seed", type=int, default=0, help="initial weights, prompt order and sampling (default 0)")
    trl.add_argument("--seeds", default="", help="several seeds (e.g. 0,1,2,3): one run each, then the spread")
    trl.add_argument(
        "--check-updates",
        default="",
        help="0-based updates (e.g. 0,1,50,100): TRL saves them, relax's trainer step replays each from TRL's "
        "weights and Adam state, and the table compares gradients and weights (no relax run)",
    )
    trl.add_argument(
        "--config",
        type=Path,
        default=None,
        help="a run config (relax train's YAML): TRL and relax colocated and distributed on its checkpoint, data "
        "and reward, each for its trainer.total_steps or --minutes; the task options above do not apply",
    )
    trl.add_argument("overrides", nargs="*", help="with --config: dotted overrides, e.g. trainer.total_steps=20")
    trl.add_argument("--model", type=Path, default=None, help="with --config: a checkpoint folder for model.source")
    trl.add_argument("--minutes", type=float, default=None, help="with --config: wall-clock budget per side")
    trl.add_argument(
        "--modes",
        default="colocated,distributed",
        help="with --config: relax's sides (default colocated,distributed; empty: TRL only)",
    )
    trl.set_defaults(func=_bench_trl)
    chaos = sub.add_parser("chaos", help="a run with random injected faults, ending with the fault table")
    chaos.add_argument("config", nargs="?", type=Path, default=None)
    chaos.add_argument("overrides", nargs="*")
    chaos.add_argument("--faults", type=_count, default=3, help="how many faults to inject (default 3)")
    chaos.add_argument(
        "--actor-faults",
        type=_count,
        default=2,
        help="SIGKILLs of the queue, weight-store and monitor actors besides (default 2: a queue mid-run, then "
        "another actor during the global restart that follows)",
    )
    chaos.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    chaos.add_argument(
        "--eval-faults",
        action="store_true",
        help="let the faults hit the Evaluator too (it makes no training data: its faults cost training nothing)",
    )
    chaos.set_defaults(func=_chaos)
    plan = sub.add_parser(
        "plan",
        help="the Trainer plan of a run config ([CONFIG] [overrides]), or the cluster planner (--model ..., as "
        "relax-plan)",
        add_help=False,
    )
    plan.add_argument("rest", nargs=argparse.REMAINDER)
    plan.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    """The ``relax`` command: runs the sub-command in ``argv`` (the command line when None).

    Returns:
        The exit code: 0 on success, 2 for a bad config, data file or model folder (the message names it).
    """
    # Workers must run in this very environment. Ray's `uv run` hook would instead rebuild an environment per
    # worker from the working directory (slow, and it breaks in a workspace); it is read when ray is imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["plan"]:  # every later argument is the plan's own (argparse would take `--model` as relax's)
        return _plan(argparse.Namespace(rest=argv[1:]))
    # A config path given first is told apart from an override by the '=' sign.
    parser = build_parser()
    # Options may stand between overrides (`relax train run.name=r --resume trainer.total_steps=200`): argparse
    # leaves the overrides after the option over; they are overrides like the others.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any("=" not in e or e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    if getattr(args, "config", None) is not None and "=" in str(args.config):
        args.overrides = [str(args.config), *args.overrides]
        args.config = None
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

"""The ``relax`` command line: ``relax train``, ``relax bench pipeline``, ``relax plan``."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["main"]


def _train(args: argparse.Namespace) -> int:
    from relax_core import ConfigError
    from relax_services.config import load_run_config
    from relax_services.controller import Controller, init_ray, make_run_dir
    from relax_services.footprint import PeakMemory, format_footprint, update_split
    from relax_services.summary import format_summary

    overrides = list(args.overrides)
    if args.ray_address is not None:
        overrides.append(f"run.ray_address={args.ray_address}")
    try:
        cfg = load_run_config(args.config, overrides)
    except ConfigError as exc:
        print(f"relax train: {exc}", file=sys.stderr)
        return 2
    if cfg.run.mode == "colocated":  # every service a thread of this process: no Ray
        from relax_services.colocated import train_colocated

        return train_colocated(cfg, args.resume)
    run_dir = make_run_dir(cfg)
    print(f"relax train: run folder {run_dir}", flush=True)
    memory = PeakMemory().start()
    try:
        started = init_ray(cfg.run.ray_address)
    except ConnectionError as exc:
        print(f"relax train: {exc}", file=sys.stderr)
        return 2
    try:
        result = Controller(cfg, run_dir, resume=args.resume).run()
    finally:
        if started:
            import ray

            ray.shutdown()
    memory.stop()
    text = format_summary(result) + "\n" + format_footprint(update_split(run_dir / "metrics.jsonl"), memory.peak_bytes)
    (run_dir / "summary.txt").write_text(text + "\n", encoding="utf-8")
    print(text, flush=True)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from relax_services.bench import run_pipeline_bench

    return run_pipeline_bench(args.taus, args.overrides, args.config)


def _bench_trl(args: argparse.Namespace) -> int:
    from relax_services.bench_trl import run_trl_bench

    return run_trl_bench(args.work, args.updates, [int(t) for t in args.taus.split(",")])


def _chaos(args: argparse.Namespace) -> int:
    from relax_services.chaos import run_chaos

    return run_chaos(args.config, args.overrides, args.faults, args.seed)


def _plan(args: argparse.Namespace) -> int:
    from relax_parallel.cli import main as plan_main

    return int(plan_main(args.rest))


def build_parser() -> argparse.ArgumentParser:
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
    train.set_defaults(func=_train)
    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    pipe = bench_sub.add_parser("pipeline", help="the same task and seeds at τ = 0 and τ > 0, side by side")
    pipe.add_argument("config", nargs="?", type=Path, default=None)
    pipe.add_argument("overrides", nargs="*")
    pipe.add_argument("--taus", default="0,1,2,4", help="comma-separated τ values (default 0,1,2,4)")
    pipe.set_defaults(func=_bench)
    trl = bench_sub.add_parser("trl", help="TRL's GRPOTrainer against relax colocated (τ = 0, 2) on one task")
    trl.add_argument("--work", type=Path, default=Path("/tmp/relax-bench-trl"), help="venv, data and runs")
    trl.add_argument("--updates", type=int, default=400, help="updates per side (default 400)")
    trl.add_argument("--taus", default="0,2", help="relax's τ values (default 0,2)")
    trl.set_defaults(func=_bench_trl)
    chaos = sub.add_parser("chaos", help="a run with random injected faults, ending with the fault table")
    chaos.add_argument("config", nargs="?", type=Path, default=None)
    chaos.add_argument("overrides", nargs="*")
    chaos.add_argument("--faults", type=int, default=3, help="how many faults to inject (default 3)")
    chaos.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    chaos.set_defaults(func=_chaos)
    plan = sub.add_parser("plan", help="parallelism plan (same as relax-plan)", add_help=False)
    plan.add_argument("rest", nargs=argparse.REMAINDER)
    plan.set_defaults(func=_plan)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Workers must run in this very environment. Ray's `uv run` hook would instead rebuild an environment per
    # worker from the working directory (slow, and it breaks in a workspace); it is read when ray is imported.
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    argv = list(sys.argv[1:] if argv is None else argv)
    # A config path given first is told apart from an override by the '=' sign.
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "config", None) is not None and "=" in str(args.config):
        args.overrides = [str(args.config), *args.overrides]
        args.config = None
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

"""What a restarted service's new process spends before its first work: importing its modules and building itself.

An in-place restart of a Rollout, Reward or Reference replaces its process: Ray starts a worker, which imports the
service's module (and with it torch, transformers and the model code) and runs the service's constructor (the
engine, the model built from its folder, the first weight sync). This script times the last two in fresh Python
processes, one per role and round, the roles interleaved so that a change of machine load hits each alike, and
prints per role the median seconds of the import and of the constructor, and which heavy modules were loaded.

    uv run python packages/relax-services/benchmarks/service_start.py --rounds 5

It measures the process, not Ray: a restart adds Ray's worker start, the restart backoff and the new actor's
registration on top (see docs/faults.md for whole restarts measured in ``relax chaos``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

ROLES = ("rollout", "reward", "reference")
HEAVY = ("torch", "transformers", "torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp")

_CHILD = """
import time, sys, json
t0 = time.perf_counter()
from relax_services.config import load_run_config
from relax_services.services import {cls}
t1 = time.perf_counter()
from relax_queue import TransferQueue
from relax_services.control.pipeline import queue_configs, service_plan
from relax_services.weights import InProcessWeightStore
cfg = load_run_config()
prompts_cfg, samples_cfg = queue_configs(cfg)
pq, sq, weights = TransferQueue(prompts_cfg), TransferQueue(samples_cfg), InProcessWeightStore(keep=2)
planned = service_plan(cfg, [], None, pq, sq, weights, None)
plan = {{role: (name, cls, args, kwargs) for name, role, cls, args, kwargs in planned}}
t2 = time.perf_counter()
name, cls, args, kwargs = plan[{role!r}]
service = cls(name, *args, **kwargs)
t3 = time.perf_counter()
print(json.dumps({{"import_s": t1 - t0, "build_s": t3 - t2, "heavy": [m for m in {heavy!r} if m in sys.modules]}}))
"""

_CLASSES = {"rollout": "RolloutService", "reward": "RewardService", "reference": "ReferenceService"}


def measure(role: str) -> dict[str, object]:
    """One fresh process: import ``role``'s service module and construct the service."""
    code = _CHILD.format(cls=_CLASSES[role], role=role, heavy=HEAVY)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--roles", nargs="*", default=list(ROLES), choices=ROLES)
    args = parser.parse_args(argv)
    runs: dict[str, list[dict[str, object]]] = {role: [] for role in args.roles}
    for _ in range(args.rounds):
        for role in args.roles:
            runs[role].append(measure(role))
    with open("/proc/loadavg", encoding="utf-8") as f:
        load = f.read().split()[:3]
    print(f"load average after the runs: {' '.join(load)}; {args.rounds} rounds")
    print(f"{'role':<10} {'import s':>9} {'build s':>8} {'total s':>8}  heavy modules loaded")
    for role, results in runs.items():
        imp = statistics.median(float(str(r["import_s"])) for r in results)
        build = statistics.median(float(str(r["build_s"])) for r in results)
        heavy = results[-1]["heavy"]
        loaded = ", ".join(map(str, heavy)) if isinstance(heavy, list) else "?"
        print(f"{role:<10} {imp:9.2f} {build:8.2f} {imp + build:8.2f}  {loaded}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What each import costs a process: private (anonymous and private file-backed) and PSS megabytes read from
``/proc/self/smaps_rollup`` after each module of a list is imported, in a fresh interpreter per order, with which of
the heavy side modules (sympy, ``torch._dynamo``, triton, pyarrow) each step brought in.

The default orders answer whether a model process can shed an import: ``torch.distributed.tensor`` (relax's
``engines.weight_buckets`` imports it at its top) before and after transformers' ``masking_utils`` (which imports
``torch._dynamo`` at its top, and with it sympy and triton), then a Rollout service's module.

    uv run python packages/relax-services/benchmarks/import_footprint.py
    uv run python packages/relax-services/benchmarks/import_footprint.py --order torch,ray,pyarrow

Measured (2 cores, torch 2.14, transformers 5.20): ``import torch`` 280 MB private; ``torch.distributed.tensor``
alone +41, ``masking_utils`` after it +59; ``masking_utils`` first +100, ``torch.distributed.tensor`` after it +0
(so a lazy import of it saves nothing in a process that runs a transformers model); a Rollout service's module
after both +8; ``import ray`` 36 and pyarrow after it +10 (Ray's serialisation context imports pyarrow in every
worker where it is installed). Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

_PROBE = """
import importlib, sys
SIDE = ("sympy", "torch._dynamo", "triton", "pyarrow")

def mem():
    d = {}
    for line in open("/proc/self/smaps_rollup"):
        parts = line.split()
        if parts[0].endswith(":"):  # the first line is the address range
            d[parts[0][:-1]] = int(parts[1]) // 1024
    return d["Private_Clean"] + d["Private_Dirty"], d["Pss"]

before = mem()
for name in sys.argv[1:]:
    importlib.import_module(name)
    now = mem()
    side = ",".join(m for m in SIDE if m in sys.modules) or "-"
    print(f"{name:<50} {now[0]:>6} {now[0] - before[0]:>+6} {now[1]:>6}  {side}")
    before = now
"""

DEFAULT_ORDERS = (
    "torch,torch.distributed.tensor,transformers.masking_utils,relax_services.services.rollout",
    "torch,transformers.masking_utils,torch.distributed.tensor",
    "ray,pyarrow",
)


def main() -> None:
    """Print, for each order, the private MB after each import, its increment, the PSS and the side modules."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--order", action="append", help="comma-separated modules, imported in this order")
    args = parser.parse_args()
    for order in args.order or DEFAULT_ORDERS:
        print(f"{'module':<50} {'private':>6} {'+MB':>6} {'PSS':>6}  side modules loaded")
        out = subprocess.run(
            [sys.executable, "-c", _PROBE, *order.split(",")], capture_output=True, text=True, check=True
        )
        print(out.stdout)


if __name__ == "__main__":
    main()

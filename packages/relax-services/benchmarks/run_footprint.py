"""Private memory (USS) and PSS of each process of a ``relax train`` run, sampled from ``/proc`` while it runs.

PSS splits every shared page between the processes that map it, so a process's PSS depends on how many other
processes on the machine map the same libraries (every worktree's virtual environment hardlinks the same torch
files): the same run reads less PSS on a loaded machine than on a quiet one. Private memory (``Private_Clean +
Private_Dirty`` of ``/proc/<pid>/smaps_rollup``) is the part no other process shares, the same however loaded the
machine is; it is what a change to a process's imports or state moves. This script runs the command, samples the
whole process tree every ``--interval`` seconds, and prints per process label (as the run summary names them) its
largest private and PSS sizes, the tree's peak sums, and an estimate of the tree's PSS on a machine running
nothing else (:func:`quiet_estimate`: anonymous pages, plus each mapped file's resident pages once).

    uv run python packages/relax-services/benchmarks/run_footprint.py -- trainer.total_steps=40
    RELAX_KEEP_TRITON=1 uv run python packages/relax-services/benchmarks/run_footprint.py -- trainer.total_steps=40

Measured on the shared 2-core machine (load average in the run's output) and recorded in the documentation
(docs/scaling.md, *Two model processes: ``run.hosts``*). Linux only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import psutil

from relax_services.reporting.footprint import _label


def _smaps(pid: int) -> tuple[int, int] | None:
    """``(private bytes, PSS bytes)`` of process ``pid``; None when it is gone or unreadable."""
    sizes: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                parts = line.split()
                if parts and parts[0].endswith(":") and len(parts) >= 2 and parts[1].isdigit():
                    sizes[parts[0][:-1]] = int(parts[1]) * 1024
    except OSError:
        return None
    return sizes.get("Private_Clean", 0) + sizes.get("Private_Dirty", 0), sizes.get("Pss", 0)


def _mapped(pid: int) -> tuple[int, dict[str, int]] | None:
    """``(anonymous bytes, {mapped file: bytes of its pages resident and not copied-on-write})`` of ``pid``."""
    anon, files = 0, {}
    path = ""
    try:
        with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
            rss = 0
            for line in f:
                parts = line.split()
                if not parts:
                    continue
                if not parts[0].endswith(":"):  # a mapping's header: address range, perms, offset, dev, inode, path
                    path = parts[5] if len(parts) > 5 and parts[5].startswith("/") else ""
                elif parts[0] == "Rss:":
                    rss = int(parts[1]) * 1024
                elif parts[0] == "Anonymous:":
                    pages = int(parts[1]) * 1024
                    anon += pages
                    if path:
                        files[path] = files.get(path, 0) + rss - pages
    except OSError:
        return None
    return anon, files


def quiet_estimate(pids: list[int]) -> int:
    """What the processes ``pids`` would hold in PSS on a machine running nothing else: each one's anonymous
    pages, plus each mapped file's resident pages counted once (the largest of the processes mapping it; they map
    mostly the same pages of a library), wherever else on the machine the same files are mapped."""
    anon, files = 0, {}
    for pid in pids:
        found = _mapped(pid)
        if found is None:
            continue
        anon += found[0]
        for path, size in found[1].items():
            files[path] = max(files.get(path, 0), size)
    return anon + sum(files.values())


def _sample(root: psutil.Process) -> dict[int, tuple[str, int, int]]:
    """``pid → (label, private, PSS)`` of ``root``'s descendants (the ``relax`` process is labelled ``driver``)."""
    out: dict[int, tuple[str, int, int]] = {}
    try:
        procs = root.children(recursive=True)
    except psutil.Error:
        return out
    for proc in procs:
        try:
            cmdline = proc.cmdline()
            label = _label(cmdline, proc.name())
            if label in ("relax", "uv") or "relax_services.cli" in " ".join(cmdline):
                label = "driver" if label != "uv" else "uv"
        except psutil.Error:
            continue
        sizes = _smaps(proc.pid)
        if sizes is not None:
            out[proc.pid] = (label, *sizes)
    return out


def main() -> None:
    """Run ``relax train`` with the given overrides, sampling its processes; print the per-label table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("overrides", nargs="*", help="relax train overrides (after --)")
    args = parser.parse_args()
    env = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}
    cmd = [sys.executable, "-m", "relax_services.cli", "train", "run.progress=none", *args.overrides]
    me = psutil.Process()
    child = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak_private: dict[int, tuple[str, int]] = {}
    peak_pss: dict[int, int] = {}
    tree_peak = (0, 0)  # (PSS sum, private sum) at the largest PSS sum
    quiet_peak = 0  # the largest quiet-machine estimate (every few samples: reading smaps costs a little)
    loads = []
    assert child.stdout is not None
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(child.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    while child.poll() is None:
        sample = _sample(me)
        for pid, (label, private, pss) in sample.items():
            if private > peak_private.get(pid, ("", 0))[1]:
                peak_private[pid] = (label, private)
            peak_pss[pid] = max(peak_pss.get(pid, 0), pss)
        total = (sum(s[2] for s in sample.values()), sum(s[1] for s in sample.values()))
        tree_peak = max(tree_peak, total)
        if len(loads) % 3 == 0:
            quiet_peak = max(quiet_peak, quiet_estimate(list(sample)))
        loads.append(os.getloadavg()[0])
        time.sleep(args.interval)
    reader.join(timeout=30)
    text = "".join(output)
    print("\n".join(line for line in text.splitlines() if "peak memory" in line or "per process" in line))
    print(f"exit code {child.returncode}; load average {min(loads):.1f}-{max(loads):.1f} during the run")
    by_label: dict[str, list[tuple[int, int]]] = {}
    for pid, (label, private) in peak_private.items():
        by_label.setdefault(label, []).append((private, peak_pss[pid]))
    print(f"{'process':<44} {'private MB':>11} {'PSS MB':>8}")
    for label, sizes in sorted(by_label.items(), key=lambda kv: -sum(p for p, _ in kv[1])):
        for private, pss in sorted(sizes, reverse=True):
            print(f"{label:<44} {private / 1e6:>11.0f} {pss / 1e6:>8.0f}")
    total_private = sum(p for sizes in by_label.values() for p, _ in sizes)
    print(f"{'sum of per-process peaks':<44} {total_private / 1e6:>11.0f} {sum(peak_pss.values()) / 1e6:>8.0f}")
    print(f"{'tree at its PSS peak':<44} {tree_peak[1] / 1e6:>11.0f} {tree_peak[0] / 1e6:>8.0f}")
    print(f"{'tree on a quiet machine (estimate, PSS)':<44} {'':>11} {quiet_peak / 1e6:>8.0f}")
    if child.returncode != 0:
        print(text[-3000:], file=sys.stderr)


if __name__ == "__main__":
    main()

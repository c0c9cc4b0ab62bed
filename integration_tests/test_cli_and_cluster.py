"""`relax train` from the command line, and the same run on a two-node Ray cluster.

Both start their own Ray instance in a subprocess (the CLI's own, and a `ray.cluster_utils.Cluster`), so they do
not share this session's Ray. The subprocesses' environment and the short run's overrides are the integration
conftest's (``cli_env``, ``cli_fast``), and the CLI run checked here is its ``cli_run``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.integration
def test_relax_train_cli_writes_run_folder(cli_run) -> None:
    # `python -m relax_services.cli train` with CLI_FAST (the session's one run, shared with test_light_driver.py)
    proc, run_dir = cli_run.proc, cli_run.run_dir
    assert cli_run.verdict["code"] == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 4/4" in proc.stdout  # progress lines (no TTY here)
    assert "held-out reward" in proc.stdout and "chance" in proc.stdout  # the closing summary
    for name in ("config.yaml", "metrics.jsonl", "summary.txt", "reward.png", "staleness.png", "queue_depth.png"):
        assert (run_dir / name).is_file(), name
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert len(kept) <= 2 and kept[-1] == "step_00000004", kept  # keep_checkpoints=2, the last at the end
    kinds = {json.loads(line)["kind"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert {"train", "eval", "queue", "rollout", "summary", "warmup"} <= kinds


@pytest.mark.integration
def test_bad_config_fails_before_anything_starts(tmp_path: Path, cli_env: dict[str, str]) -> None:
    cmd = [sys.executable, "-m", "relax_services.cli", "train", "staleness.tau=-1", f"run.output_dir={tmp_path}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env)
    assert proc.returncode == 2
    assert "staleness.tau" in proc.stderr and ">= 0" in proc.stderr
    assert not any(tmp_path.iterdir())  # no run folder, no Ray


_TWO_NODE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import ray
    from ray.cluster_utils import Cluster
    from relax_services.config import load_run_config
    from relax_services.control.controller import Controller

    out = Path(sys.argv[1])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"trainer_node": 1}})
    cluster.add_node(num_cpus=1, resources={"rollout_node": 1})
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    try:
        cfg = load_run_config(None, sys.argv[2:] + [
            f"run.output_dir={out}", "run.name=two-node", "run.progress=none",
            "run.placement={trainer: trainer_node, rollout: rollout_node}",
        ])
        run_dir = out / "two-node"
        run_dir.mkdir(parents=True)
        result = Controller(cfg, run_dir).run()
        print(json.dumps({"steps": result.steps, "nodes": result.service_nodes}))
    finally:
        ray.shutdown()
        cluster.shutdown()
    """
)


@pytest.mark.slow
@pytest.mark.integration
def test_rollout_and_trainer_on_different_nodes(tmp_path: Path, cli_env: dict[str, str], cli_fast: list[str]) -> None:
    args = [a for a in cli_fast if not a.startswith("run.report")]
    proc = subprocess.run(
        [sys.executable, "-c", _TWO_NODE, str(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env=cli_env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["steps"] == 4
    nodes = report["nodes"]
    assert nodes["trainer"] != nodes["rollout-0"], nodes


@pytest.mark.slow
@pytest.mark.integration
def test_sigterm_checkpoints_and_leaves_no_process_behind(
    tmp_path: Path, cli_env: dict[str, str], cli_fast: list[str]
) -> None:
    import signal
    import time

    import psutil

    cmd = [
        sys.executable,
        "-m",
        "relax_services.cli",
        "train",
        *cli_fast,
        "trainer.total_steps=100000",
        "trainer.max_minutes=10",
        f"run.output_dir={tmp_path}",
        "run.name=term",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env, cwd=tmp_path)
    metrics = tmp_path / "term" / "metrics.jsonl"
    deadline = time.monotonic() + 400
    while time.monotonic() < deadline and not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
        time.sleep(1)
    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    family = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
    assert len(family) > 5  # Ray's own processes and one per service
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:]
    assert "signal SIGTERM" in out  # the summary names why it stopped
    checkpoints = sorted((tmp_path / "term" / "checkpoints").iterdir())
    assert checkpoints and checkpoints[-1].name != "step_00000000", checkpoints  # a checkpoint at the stop
    survivors = []
    for pid in family:
        try:
            p = psutil.Process(pid)
        except psutil.NoSuchProcess:
            continue
        if p.status() != psutil.STATUS_ZOMBIE:
            survivors.append((pid, p.name()))
    assert not survivors, survivors


@pytest.mark.integration
def test_unreachable_ray_address_is_a_clear_error(tmp_path: Path, cli_env: dict[str, str]) -> None:
    cmd = [
        sys.executable,
        "-m",
        "relax_services.cli",
        "train",
        "--ray-address",
        "127.0.0.1:9",
        f"run.output_dir={tmp_path}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=cli_env)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cannot reach the Ray cluster" in proc.stderr and "127.0.0.1:9" in proc.stderr


@pytest.mark.slow
@pytest.mark.integration
def test_sigkill_of_the_driver_leaves_no_ray_process_behind(
    tmp_path: Path, cli_env: dict[str, str], cli_fast: list[str]
) -> None:
    """Ray's dashboard and runtime-env agents used to live on under PID 1 after a SIGKILL of ``relax train``."""
    import signal
    import time

    import psutil

    cmd = [sys.executable, "-m", "relax_services.cli", "train", *cli_fast, "trainer.total_steps=100000"]
    cmd += [f"run.output_dir={tmp_path}", "run.name=kill"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=cli_env, cwd=tmp_path)
    metrics = tmp_path / "kill" / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (metrics.is_file() and '"kind": "train"' in metrics.read_text()):
        time.sleep(1)
    assert proc.poll() is None
    family = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    assert len(family) > 5  # Ray's own processes and one per service
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    def survivors() -> list[tuple[int, str]]:
        out = []
        for pid in family:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append((pid, p.name()))
            except psutil.NoSuchProcess:
                continue
        return out

    deadline = time.monotonic() + 30
    while survivors() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not survivors(), survivors()

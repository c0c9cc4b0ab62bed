"""A local Ray started by ``init_ray`` runs only what relax uses: the actors get the run's environment (threads and
glibc's malloc settings) from the moment they start, Ray's head runs no autoscaler monitor, log monitor or
dashboard server and prestarts no idle worker, its system config records no task events, and an actor that dies
still comes back with Ray's restart and the same environment.

Each case starts Ray in a fresh interpreter (as ``relax train`` does) and reads what runs from ``/proc``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from relax_services.hosting.ray_init import ACTOR_ENV, LOCAL_SYSTEM_CONFIG, UNUSED_HEAD_PROCESSES

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux only)")

_SCRIPT = """
import json, os, signal
import psutil, ray
from relax_services.hosting.ray_init import init_ray


@ray.remote(max_restarts=1, max_task_retries=0)
class Probe:
    def start_env(self):
        # /proc/self/environ is the environment the process was exec'd with (what glibc read), not os.environ.
        raw = open("/proc/self/environ", "rb").read().split(b"\\0")
        return os.getpid(), dict(item.decode().split("=", 1) for item in raw if b"=" in item)

    def triton_blocked(self):
        import sys
        return "triton" in sys.modules and sys.modules["triton"] is None


def tree():
    root = psutil.Process()
    out = []
    for proc in root.children(recursive=True):
        try:
            out.append(" ".join(proc.cmdline()))
        except psutil.Error:
            pass
    return out


started = init_ray(None)
probe = Probe.remote()
pid, env = ray.get(probe.start_env.remote(), timeout=120)
first = tree()
triton_blocked = ray.get(probe.triton_blocked.remote(), timeout=120)
os.kill(pid, signal.SIGKILL)
while True:  # the call fails until Ray has restarted the actor in a new process
    try:
        pid2, env2 = ray.get(probe.start_env.remote(), timeout=120)
        break
    except ray.exceptions.RayActorError:
        continue
config = ray._private.state.state.get_system_config()
ray.shutdown()
print(json.dumps({"started": started, "env": env, "tree": first, "pid": pid, "pid2": pid2, "env2": env2,
                  "triton_blocked": triton_blocked, "auth_mode": os.environ.get("RAY_AUTH_MODE"),
                  "config": {key: config.get(key) for key in %r}}))
"""


@pytest.fixture(scope="module")
def local_ray() -> dict[str, object]:
    script = _SCRIPT % (sorted(LOCAL_SYSTEM_CONFIG),)
    env = {k: v for k, v in os.environ.items() if k != "RAY_AUTH_MODE"}  # Ray's own default, as for a new user
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=600, check=False, env=env
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    result["stderr"] = out.stderr
    return result


def test_a_local_instance_keeps_token_authentication_without_its_notice(local_ray: dict[str, object]) -> None:
    """Ray's default for a new local instance (token authentication) stays on, and its notice is not printed."""
    assert local_ray["auth_mode"] == "token"
    assert "Token authentication" not in str(local_ray["stderr"]), str(local_ray["stderr"])[-2000:]


def test_actors_start_with_the_run_environment(local_ray: dict[str, object]) -> None:
    assert local_ray["started"] is True
    env = local_ray["env"]
    assert isinstance(env, dict)
    assert {key: env.get(key) for key in ACTOR_ENV} == ACTOR_ENV
    # glibc reads these at start-up only: they must be in the exec'd environment, with the values documented.
    assert env["MALLOC_ARENA_MAX"] == "2"


def test_workers_run_the_setup_hook_before_any_actor(local_ray: dict[str, object]) -> None:
    """The run's worker setup hook ran in the actor's process before its class was loaded: triton is marked absent
    there exactly where ``keep_triton_out`` says it should be (no GPU device, no ``RELAX_KEEP_TRITON=1``)."""
    import os

    from relax_services.hosting.worker_setup import KEEP_TRITON_ENV, gpu_present

    expected = not gpu_present() and os.environ.get(KEEP_TRITON_ENV) != "1"
    assert local_ray["triton_blocked"] is expected


def test_head_runs_no_unused_process(local_ray: dict[str, object]) -> None:
    tree = local_ray["tree"]
    assert isinstance(tree, list)
    scripts = {
        "monitor": "autoscaler/_private/monitor.py",
        "log_monitor": "log_monitor.py",
        "dashboard": "dashboard.py",
    }
    assert set(scripts) == set(UNUSED_HEAD_PROCESSES)
    for process_type, script in scripts.items():
        assert not [cmd for cmd in tree if script in cmd], f"{process_type} still runs"
    # What relax needs is still there: GCS, the raylet, and the agents the raylet fate-shares with.
    for needed in ("gcs_server", "raylet", "ray::DashboardAgent", "ray::RuntimeEnvAgent"):
        assert [cmd for cmd in tree if needed in cmd], f"{needed} missing"
    # No worker waits idle: the one worker is the actor's (prestarting is off).
    assert not [cmd for cmd in tree if cmd.startswith("ray::IDLE")], tree


def test_system_config_reaches_the_head(local_ray: dict[str, object]) -> None:
    assert local_ray["config"] == LOCAL_SYSTEM_CONFIG


def test_a_killed_actor_restarts_with_the_same_environment(local_ray: dict[str, object]) -> None:
    assert local_ray["pid2"] != local_ray["pid"]
    env2 = local_ray["env2"]
    assert isinstance(env2, dict)
    assert {key: env2.get(key) for key in ACTOR_ENV} == ACTOR_ENV


def test_a_ray_without_the_private_node_api_keeps_its_head_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray version whose node object lacks ``_kill_process_type`` leaves the processes running instead of failing
    the run's start-up (``stop_unused_head_processes`` uses that private name)."""
    import ray._private.worker as ray_worker

    from relax_services.hosting.ray_init import stop_unused_head_processes

    class OldNode:
        def __init__(self) -> None:
            self.head = True
            self.all_processes = {"monitor": [object()], "log_monitor": [object()]}

    node = OldNode()
    monkeypatch.setattr(ray_worker, "_global_node", node, raising=False)
    assert stop_unused_head_processes() == []
    assert set(node.all_processes) == {"monitor", "log_monitor"}


def test_wait_gone_returns_once_the_process_has_ended() -> None:
    """The driver waits for the warm-up task's process to end (``wait_gone``) before the services start."""
    from relax_services.hosting.ray_init import alive, wait_gone

    quick = subprocess.Popen([sys.executable, "-c", "pass"])
    assert wait_gone(quick.pid, timeout_s=120) is True  # a zombie not yet reaped counts as gone
    quick.wait()
    assert not alive(quick.pid)
    lasting = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert wait_gone(lasting.pid, timeout_s=0.2) is False and alive(lasting.pid)
    finally:
        lasting.kill()
        lasting.wait()

"""The watch over a pipeline's queue, store and monitor actors: a SIGKILLed one is found and named, with Ray's reason;
live ones pass."""

from __future__ import annotations

import os
import signal
import time

import pytest

from relax_queue import QueueConfig, RowInput, TaskSpec, create_ray_queue
from relax_services.faults.actor_watch import ActorLost, ActorWatch, creation_error, why_dead
from relax_services.faults.health import GlobalRestartNeeded
from relax_services.faults.monitor import HealthMonitor


def test_why_names_rays_memory_monitor() -> None:
    exc = RuntimeError("Task was killed due to the node running low on memory. Memory on the node was 23.1GB")
    assert why_dead(exc).startswith("killed by Ray's memory monitor (OutOfMemoryError")
    text = "The actor is dead because its worker process has died. Worker exit type: INTENDED_USER_EXIT Worker"
    assert why_dead(RuntimeError(text)) == "its process ended (Ray: worker exit type INTENDED_USER_EXIT)"


def test_why_names_what_an_actors_constructor_raised() -> None:
    """Ray's text of an actor whose ``__init__`` raised (as Ray 2.60 words it, colour codes included): its first line
    names only the actor; the reason is the exception at the end of the traceback."""
    text = (
        "The actor died because of an error raised in its creation task, \x1b[36mray::A.__init__()\x1b[39m (pid=1, "
        'ip=192.0.2.2, actor_id=f0, repr=<A object>)\n           ^^^^^^^^\n  File "/x/trainer.py", line 6, in '
        "__init__\n    raise RuntimeError(...)\ntorch.distributed.DistBackendError: NCCL error: invalid usage\n"
        "Last error: duplicate GPU detected"
    )
    assert why_dead(RuntimeError(text)) == (
        "RuntimeError: its constructor raised torch.distributed.DistBackendError: NCCL error: invalid usage Last "
        "error: duplicate GPU detected"
    )
    assert creation_error("x" * 10 + "\nValueError: " + "y" * 1000) == "ValueError: " + "y" * 387 + "…"
    assert creation_error("The actor died because of an error raised in its creation task, no traceback") is None
    bare = "The actor died because of an error raised in its creation task, ray::A.__init__() (pid=1)"
    assert why_dead(RuntimeError(bare)) == f"RuntimeError: {bare}"


@pytest.mark.integration
def test_a_killed_actor_is_found_and_named(ray_session) -> None:
    ray = ray_session
    monitor = ray.remote(HealthMonitor).options(num_cpus=0).remote()
    queue = create_ray_queue(f"watch-probe-{os.getpid()}", QueueConfig(tasks=(TaskSpec("a"),)))
    watch = ActorWatch({"health_monitor": monitor, "sample_queue": queue.actor})
    try:
        watch.check()  # both alive: nothing raised
        watch.poll()
        assert watch.find(RuntimeError("some call failed")) is None
        pid = watch.pid("sample_queue")
        assert pid != os.getpid() and pid != watch.pid("health_monitor")
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(ActorLost) as caught:
            watch.check(timeout_s=120)
        lost = caught.value
        assert isinstance(lost, GlobalRestartNeeded)  # the controller answers it with a global restart
        assert lost.actor == "sample_queue" and "SIGKILL" in lost.why
        assert str(lost).startswith("the sample queue actor (sample_queue) died: its process ended unexpectedly")
        # The loop's watch notices it too, without waiting on any call: a ping in flight fails.
        for _ in range(1200):
            try:
                watch.poll()
            except ActorLost as exc:
                assert exc.actor == "sample_queue"
                break
            time.sleep(0.1)
        else:
            pytest.fail("poll never reported the dead queue")
        ray.get(monitor.snapshot.remote())  # the other actor is untouched
    finally:
        for actor in (monitor, queue.actor):
            ray.kill(actor, no_restart=True)


@pytest.mark.integration
@pytest.mark.parametrize("injected", [None, "health_monitor"])
def test_a_shared_process_is_pinged_once_and_its_death_names_every_key(ray_session, injected) -> None:
    """The queues, the policy weight store and the health monitor share one process: every face answers on one
    actor, its death is reported under the key a fault injection named (else its first key), and the report names
    the others."""
    from relax_queue._ray_actor import ROUTED_METHODS
    from relax_services.hosting.light_host import create_light_actor
    from relax_services.weights import WeightStoreActor

    ray = ray_session
    # Disjoint faces: a method of one that another also had would hide it in the shared class.
    store_methods = {m for m in vars(WeightStoreActor) if not m.startswith("_")}
    monitor_methods = {m for m in vars(HealthMonitor) if not m.startswith("_")}
    assert store_methods and monitor_methods and not store_methods & monitor_methods
    assert not (store_methods | monitor_methods) & set(ROUTED_METHODS)
    config = QueueConfig(tasks=(TaskSpec("a"),))
    light = create_light_actor(f"watch-shared-{os.getpid()}-{injected}", {"prompts": config, "samples": config})
    other = create_ray_queue(f"watch-shared-q-{os.getpid()}-{injected}", QueueConfig(tasks=(TaskSpec("a"),)))
    store, monitor = light.weights, light.health
    keys = {"prompt_queue": light.queues["prompts"].actor, "sample_queue": light.queues["samples"].actor}
    watch = ActorWatch({**keys, "weights": store.actor, "health_monitor": monitor, "critic_weights": other.actor})
    try:
        ray.get(monitor.beat.remote("rollout-0", 3, 11))
        assert store.latest_version() is None and set(ray.get(monitor.snapshot.remote())) == {"rollout-0"}
        light.queues["samples"].put_many([RowInput("k", {"x": 1})])
        assert light.queues["samples"].metrics()["depth_rows"] == 1
        assert light.queues["prompts"].metrics()["depth_rows"] == 0
        pids = {key: watch.pid(key) for key in ("prompt_queue", "sample_queue", "weights", "health_monitor")}
        assert len(set(pids.values())) == 1 and watch.pid("critic_weights") not in pids.values(), pids
        watch.check()
        watch.poll()
        assert sorted(watch._pending) == ["critic_weights", "prompt_queue"]  # one ping per process
        if injected is not None:
            watch.killed(injected)
        os.kill(watch.pid("health_monitor"), signal.SIGKILL)
        with pytest.raises(ActorLost) as caught:
            watch.check(timeout_s=120)
        lost = caught.value
        named = injected or "prompt_queue"
        assert lost.actor == named
        assert sorted(lost.shared) == sorted({"prompt_queue", "sample_queue", "weights", "health_monitor"} - {named})
        title = {"prompt_queue": "the prompt queue", "health_monitor": "the health monitor"}
        assert str(lost).startswith(f"{title[named]} actor ({named}) died: its process ended unexpectedly"), lost
        assert "the policy weight store (weights)" in lost.why, lost.why
        ray.get(other.actor.__ray_ready__.remote())  # the other process is untouched
    finally:
        for actor in (monitor, other.actor):
            ray.kill(actor, no_restart=True)

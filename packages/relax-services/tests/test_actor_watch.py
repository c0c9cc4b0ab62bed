"""The watch over a pipeline's queue, store and monitor actors: a SIGKILLed one is found and named, with Ray's reason;
live ones pass."""

from __future__ import annotations

import os
import signal
import time

import pytest

from relax_queue import QueueConfig, TaskSpec, create_ray_queue
from relax_services._actor_watch import ActorLost, ActorWatch, why_dead
from relax_services._health_monitor import HealthMonitor
from relax_services.health import GlobalRestartNeeded


def test_why_names_rays_memory_monitor() -> None:
    exc = RuntimeError("Task was killed due to the node running low on memory. Memory on the node was 23.1GB")
    assert why_dead(exc).startswith("killed by Ray's memory monitor (OutOfMemoryError")
    text = "The actor is dead because its worker process has died. Worker exit type: INTENDED_USER_EXIT Worker"
    assert why_dead(RuntimeError(text)) == "its process ended (Ray: worker exit type INTENDED_USER_EXIT)"


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

"""A pipeline's services start while its queue, store and monitor actors are watched: one of those actors dying is
acted on while services are still building their models, not after every service came up; the services that came
up are the ones with a process id, and only they are asked to stop (the ones still building are killed)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from relax_queue import QueueConfig, TaskSpec, create_ray_queue
from relax_services.config import load_run_config
from relax_services.control.pipeline import Pipeline, ServiceSpec
from relax_services.faults.actor_watch import ActorLost, ActorWatch
from relax_services.faults.monitor import HealthMonitor
from relax_services.weights import RayWeightStore


def _service_classes(folder: Path) -> tuple[type, type]:
    """A service that starts at once and one whose build ends only when ``folder/release`` exists (a model that
    takes as long as the test wants). Made in a function: Ray pickles them by value, the workers need not import
    this test module. A service asked to stop writes ``folder/stopped-<name>``."""

    class Quick:
        def __init__(self, name: str, **_: object) -> None:
            self.name = name

        def start(self) -> int:
            return os.getpid()

        def stop(self, timeout: float = 10.0) -> bool:
            (folder / f"stopped-{self.name}").touch()
            return True

    class Building(Quick):
        def __init__(self, name: str, **kwargs: object) -> None:
            super().__init__(name, **kwargs)
            deadline = time.monotonic() + 600.0  # bounded: a test that failed must not leave it waiting for ever
            while not (folder / "release").exists() and time.monotonic() < deadline:
                time.sleep(0.05)

    return Quick, Building


@pytest.mark.integration
@pytest.mark.parametrize("dies", ["health_monitor", "sample_queue", "weights"])
def test_an_actor_death_is_acted_on_before_the_building_services_come_up(ray_session, tmp_path, dies) -> None:
    ray = ray_session
    quick, building = _service_classes(tmp_path)
    tag = f"start-probe-{os.getpid()}-{dies}"
    tasks = QueueConfig(tasks=(TaskSpec("a"),))
    actors: list[Any] = []
    try:
        prompts = create_ray_queue(f"{tag}-prompts", tasks)
        actors.append(prompts.actor)
        samples = create_ray_queue(f"{tag}-samples", tasks)
        actors.append(samples.actor)
        weights = RayWeightStore.create(name=f"{tag}-weights", keep=2)
        actors.append(weights.actor)
        monitor = ray.remote(HealthMonitor).options(num_cpus=0).remote()
        actors.append(monitor)
        names = ["quick-0", "building-0", "quick-1", "building-1"]
        services = {n: ServiceSpec(n, "reward", quick if n.startswith("quick") else building, ()) for n in names}
        pipeline = Pipeline(load_run_config(), tag, prompts, samples, weights, monitor, services)
        watch = ActorWatch(pipeline.actors())
        killed: list[int] = []

        def kill_once_the_quick_ones_are_up() -> None:
            # The death comes after two services came up and while two still build, as a ``during_restart`` fault
            # lands while a global restart brings the services back.
            if not killed and services["quick-0"].pid is not None and services["quick-1"].pid is not None:
                killed.append(watch.pid(dies))
                os.kill(killed[0], signal.SIGKILL)
            watch.poll()

        with pytest.raises(ActorLost) as caught:
            pipeline.start(kill_once_the_quick_ones_are_up, poll_s=0.05)
        assert caught.value.actor == dies and killed
        # Counted, not timed: start returned while the building services were still in their constructors (they
        # cannot end before ``release`` exists), so the death was acted on before they came up.
        assert [n for n in names if services[n].pid is not None] == ["quick-0", "quick-1"]
        assert not (tmp_path / "release").exists()
        pipeline.stop()
        # The services that came up were asked to stop; the ones still building were killed without being asked.
        assert sorted(p.name for p in tmp_path.glob("stopped-*")) == ["stopped-quick-0", "stopped-quick-1"]
        for name in ("building-0", "building-1"):
            with pytest.raises(ray.exceptions.RayActorError):
                ray.get(services[name].handle.__ray_ready__.remote(), timeout=120)
    finally:
        (tmp_path / "release").touch()
        for actor in actors:
            with contextlib.suppress(Exception):  # the killed one is gone already
                ray.kill(actor, no_restart=True)


@pytest.mark.integration
def test_without_a_death_every_service_starts_and_has_its_pid(ray_session, tmp_path) -> None:
    ray = ray_session
    quick, _ = _service_classes(tmp_path)
    tag = f"start-probe-{os.getpid()}-alive"
    tasks = QueueConfig(tasks=(TaskSpec("a"),))
    prompts = create_ray_queue(f"{tag}-prompts", tasks)
    samples = create_ray_queue(f"{tag}-samples", tasks)
    weights = RayWeightStore.create(name=f"{tag}-weights", keep=2)
    monitor = ray.remote(HealthMonitor).options(num_cpus=0).remote()
    services = {n: ServiceSpec(n, "reward", quick, ()) for n in ("a", "b", "c")}
    pipeline = Pipeline(load_run_config(), tag, prompts, samples, weights, monitor, services)
    watch = ActorWatch(pipeline.actors())
    calls: list[int] = []

    def counted_poll() -> None:
        calls.append(1)
        watch.poll()

    try:
        pipeline.start(counted_poll, poll_s=0.05)
        assert calls  # the watch ran while the services started
        pids = {n: s.pid for n, s in services.items()}
        assert all(pid is not None and pid != os.getpid() for pid in pids.values()), pids
        assert pids == {n: ray.get(s.handle.start.remote(), timeout=60) for n, s in services.items()}
        watch.check()  # every watched actor is still alive
    finally:
        pipeline.stop()

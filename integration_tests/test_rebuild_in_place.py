"""A service actor whose work loop raised is rebuilt in its own process (Ray builds actors with ``__new__`` and
``__init__`` apart, so the rebuild is handed the creation arguments again)."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from relax_services.config import RunConfig


def _status_until(handle: object, condition: Callable[[dict[str, object]], bool]) -> dict[str, object]:
    import ray

    while True:  # bounded by pytest's timeout; no timed assert
        status: dict[str, object] = ray.get(handle.status.remote())  # type: ignore[attr-defined]
        if condition(status):
            return status
        time.sleep(0.1)


@pytest.mark.integration
@pytest.mark.slow
def test_a_reward_actor_whose_loop_raised_is_rebuilt_in_its_own_process(
    ray_session: object, small_config: Callable[..., RunConfig]
) -> None:
    import ray

    from relax_queue import create_ray_queue
    from relax_services.control.pipeline import ServiceSpec, queue_configs
    from relax_services.services import RewardService

    cfg = small_config()
    _, samples = queue_configs(cfg)
    queue = create_ray_queue("rebuild-samples", samples)
    spec = ServiceSpec("reward", "reward", RewardService, (cfg, queue), {"health": None})
    try:
        spec.create("rebuild")
        pid = spec.pid
        ray.get(spec.handle.inject.remote("raise"))
        failed = _status_until(spec.handle, lambda s: s["error"] is not None)
        assert failed["error"] == "RuntimeError: injected fault in reward"
        assert ray.get(spec.handle.rebuild.remote(spec.name, *spec.args, **spec.kwargs)) == pid  # the same process
        again = _status_until(spec.handle, lambda s: int(str(s["progress"])) > 0)
        assert again["error"] is None and again["pid"] == pid
    finally:
        ray.kill(spec.handle, no_restart=True)
        ray.kill(queue.actor, no_restart=True)

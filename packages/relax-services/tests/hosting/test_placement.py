"""Placement of a GPU run on a Ray instance that declares 4 GPUs it does not have: every process's actor sees
exactly the GPU ids the dry run printed, a trainer group of 2 and two rollout replicas fit, a third replica is
refused before anything starts (``run.device=auto`` falls back to the CPU instead). In a fresh interpreter: the
test session's own Ray declares no GPU."""

from __future__ import annotations

import pytest

from relax_services.config import load_run_config
from relax_services.hosting.placement import Placement

pytestmark = pytest.mark.integration

SCRIPT = r"""
import json, os, sys
import ray
from relax_services.config import load_run_config
from relax_services.control.dry_run import dry_run_rows, format_dry_run
from relax_services.control.launch import LaunchError, resolve_devices
from relax_services.control.pipeline import ServiceSpec
from relax_services.hosting.placement import Placement, service_roles

class Probe:
    '''Stands for a service (spawned as the pipeline spawns one): reports what its process sees.'''
    def __init__(self, name, *args, **kwargs):
        self.name = name
    def visible(self):
        return [i for i in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if i]

ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
base = ["trainer.world_size=2", "run.hosts=[]", "eval.gpus=0", "algorithm.kl_coef=0"]
cfg = resolve_devices(load_run_config(None, [*base, "rollout.replicas=2"]))  # run.device=auto
rows = dry_run_rows(cfg, "dry")
printed = {r.slot.process: list(r.site.gpu_ids) for r in rows if r.site is not None}
placement = Placement.create(cfg, "real")
seen = {}
for name, role in service_roles(cfg):
    spec = ServiceSpec(name, role, Probe, ())
    spec.placement = placement.options(name)
    spec.spawn("real")
    seen[name] = ray.get(spec.handle.visible.remote())
ranks = placement.trainer_ranks()
for r in range(cfg.trainer.world_size):  # as TrainerGroup places its ranks
    actor = ray.remote(Probe).options(num_cpus=0, **ranks.options(r)).remote(f"rank-{r}")
    seen[f"trainer-rank-{r}"] = ray.get(actor.visible.remote())
placement.remove()
try:
    resolve_devices(load_run_config(None, [*base, "rollout.replicas=3", "run.device=cuda"]))
    refused = None
except LaunchError as exc:
    refused = str(exc)
fallback = resolve_devices(load_run_config(None, [*base, "rollout.replicas=3"])).run.device  # auto
try:
    resolve_devices(load_run_config(None, ["run.device=cuda", "run.mode=colocated"]))
    colocated = None
except LaunchError as exc:
    colocated = str(exc)
print(json.dumps({"device": cfg.run.device, "printed": printed, "seen": seen, "table": format_dry_run(cfg, rows),
                  "refused": refused, "colocated": colocated, "fallback": fallback}))
ray.shutdown()
"""


def test_actors_see_the_gpus_the_dry_run_printed(run_script) -> None:  # type: ignore[no-untyped-def]
    out = run_script(SCRIPT)
    assert out["device"] == "cuda"  # auto: Ray reports GPUs
    printed, seen = out["printed"], out["seen"]
    gpu_processes = ["rollout-0", "rollout-1", "trainer-rank-0", "trainer-rank-1"]
    assert sorted(printed) == sorted(gpu_processes), out["table"]
    for process in gpu_processes:
        assert seen[process] == printed[process] and len(printed[process]) == 1, (process, out["table"])
    assert sorted(gpu for p in gpu_processes for gpu in printed[p]) == ["0", "1", "2", "3"]  # 4 GPUs, each once
    for process in ("trainer", "reward", "eval"):  # no GPU: the group's driver, the Reward, eval.gpus=0
        assert seen[process] == [] and process not in printed
    for process in gpu_processes:
        assert process in out["table"]
    assert out["refused"].startswith(
        "the run asks for 5 GPUs (trainer.world_size=2 × trainer.gpus_per_rank=1 + rollout.replicas=3 × "
        "rollout.gpus=1), but Ray reports 4"
    )
    assert out["fallback"] == "cpu"  # run.device=auto: a run the GPUs cannot hold trains on the CPU
    assert out["colocated"] == "run.device='cuda', but torch in this process reports no GPU; use run.device=cpu or auto"


def test_a_cpu_run_creates_no_placement_group() -> None:
    # No Ray call at all: a CPU run places its processes as before.
    assert Placement.create(load_run_config(None, ["run.device=cpu"]), "cpu-run") is None

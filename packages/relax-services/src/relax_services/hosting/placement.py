"""Where a run's processes go: the GPUs each reserves and the Ray placement groups that hold them.

A run's processes are its services' actors, the shared hosts of ``run.hosts`` and, with a group training engine,
the Trainer's ranks (:func:`run_processes`). On a GPU run (``run.device`` resolved to ``cuda``) each process that
computes with a model reserves its role's GPUs (:func:`~relax_services.config.devices.role_gpus`; a host the largest
of its members', as its roles share its devices) in a placement group: the Trainer's ranks in one group packed on as
few nodes as hold them (``PACK``: NCCL within a node), every other GPU process in a second group spread over the
nodes (``SPREAD``: rollout replicas apart). A bundle's GPUs are fixed when the group is created, so a process that
restarts into its bundle gets the same GPU ids, and the dry run (:func:`probe_placement`) shows the ids the run's
processes will hold. A CPU run creates no placement group (Ray places the processes as before).

Light: Ray is imported inside the functions that create or probe groups.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from relax_services.config.devices import GPU_ROLES, DeviceError, dtype_of, gpu_field, role_gpus
from relax_services.config.hosts import host_resource
from relax_services.config.trainer_group import GROUP_TRAIN_ENGINES

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

    from relax_services.config import RunConfig

__all__ = [
    "Placement",
    "ProcessSlot",
    "RankPlacement",
    "SlotSite",
    "bundle_options",
    "check_cluster",
    "host_members",
    "host_name",
    "is_extra_replica",
    "probe_placement",
    "replica_name",
    "run_processes",
    "service_roles",
]

PLACEMENT_TIMEOUT_S = 60.0
"""Seconds a placement group may take to be placed before the run stops (the cluster cannot hold it)."""


def service_roles(cfg: RunConfig) -> list[tuple[str, str]]:
    """``(service name, role)`` of every service of the run, in the order the pipeline builds them: the Trainer, the
    Rollout workers, the Reward, the Reference (a KL term), the Critic (an estimator with a critic), the
    Evaluator."""
    names = [("trainer", "trainer")]
    names += [(replica_name(i), "rollout") for i in range(cfg.rollout.replicas)]
    names.append(("reward", "reward"))
    if cfg.algorithm.uses_reference:
        names.append(("reference", "reference"))
    if cfg.algorithm.uses_critic:
        names.append(("critic", "critic"))
    names.append(("eval", "eval"))
    return names


def host_name(members: Sequence[str]) -> str:
    """The name of the shared host of these services (its actor's name in the run's namespace)."""
    return "host-" + "-".join(members)


def host_members(hosts: Sequence[Sequence[str]], services: Sequence[tuple[str, str]]) -> list[list[str]]:
    """The services each host of ``run.hosts`` holds, given ``(name, role)`` of the run's services: every service of
    its roles, in build order, except that of the Rollout replicas only the first (``rollout-0``) joins a host: each
    further replica has a process of its own, so replicas never share a process (nor the GIL) and one can be added
    or removed while the run goes on (``relax scale``). A host that would hold a single service (its other roles are
    not in this run, e.g. no Reference without a KL term) is none: that service keeps a process of its own."""
    members = [[name for name, role in services if role in roles and not is_extra_replica(name)] for roles in hosts]
    return [names for names in members if len(names) >= 2]


def replica_name(index: int) -> str:
    """The service name of Rollout replica ``index`` (``rollout-0``, ``rollout-1``, ...)."""
    return f"rollout-{index}"


def is_extra_replica(name: str) -> bool:
    """Whether ``name`` is a Rollout replica other than the first (never hosted, see :func:`host_members`)."""
    prefix, _, index = name.rpartition("-")
    return prefix == "rollout" and index.isdigit() and int(index) > 0


@dataclass(frozen=True)
class ProcessSlot:
    """One process of a run and what it reserves.

    Attributes:
        process: The process's name: a service's, a shared host's (:func:`host_name`) or ``trainer-rank-R``.
        roles: The roles computing in it.
        gpus: GPUs it reserves (0: none, Ray places it freely).
        dtype: Its models' weight dtype (the roles' ``dtype_of``, joined by ``/`` when they differ).
        group: Its placement group: ``trainer`` (packed) or ``roles`` (spread); None without GPUs.
        bundle: Its bundle's index in that group.
        resource: The ``run.placement`` resource its node must have, or None.
    """

    process: str
    roles: tuple[str, ...]
    gpus: float
    dtype: str
    group: Literal["trainer", "roles"] | None = None
    bundle: int = 0
    resource: str | None = None


def run_processes(cfg: RunConfig) -> list[ProcessSlot]:
    """The processes of a distributed run in build order, each with its GPUs, dtype and bundle (``cfg`` with its
    device resolved; on a CPU run every count is 0)."""
    services = service_roles(cfg)
    role_of = dict(services)
    hosted = {name: members for members in host_members(cfg.run.hosts, services) for name in members}
    group_trainer = cfg.trainer.engine in GROUP_TRAIN_ENGINES
    slots: list[ProcessSlot] = []
    seen: set[str] = set()
    for name, _ in services:
        members = hosted.get(name, [name])
        if members[0] in seen:
            continue
        seen.add(members[0])
        roles = tuple(dict.fromkeys(role_of[m] for m in members))
        computing = [r for r in roles if r in GPU_ROLES and not (r == "trainer" and group_trainer)]
        gpus = max((role_gpus(cfg, r) for r in computing), default=0.0)
        dtypes = "/".join(dict.fromkeys(dtype_of(cfg, r) for r in computing)) or "-"
        resource = host_resource([cfg.run.placement.get(r) for r in roles])
        process = host_name(members) if len(members) > 1 else name
        slots.append(ProcessSlot(process, roles, gpus, dtypes, resource=resource))
    if group_trainer:
        gpus, dtype = role_gpus(cfg, "trainer"), dtype_of(cfg, "trainer")
        resource = cfg.run.placement.get("trainer")
        slots += [
            ProcessSlot(f"trainer-rank-{r}", ("trainer",), gpus, dtype, resource=resource)
            for r in range(cfg.trainer.world_size)
        ]
    return _assign_bundles(slots)


def _assign_bundles(slots: list[ProcessSlot]) -> list[ProcessSlot]:
    counts = {"trainer": 0, "roles": 0}
    out = []
    for slot in slots:
        if slot.gpus <= 0:
            out.append(slot)
            continue
        group: Literal["trainer", "roles"] = "trainer" if slot.roles == ("trainer",) else "roles"
        out.append(ProcessSlot(**{**slot.__dict__, "group": group, "bundle": counts[group]}))
        counts[group] += 1
    return out


def _asked(cfg: RunConfig, slots: Sequence[ProcessSlot]) -> str:
    """What the run asks, by field: ``trainer.world_size=2 × trainer.gpus_per_rank=1 + rollout.replicas=2 ×
    rollout.gpus=1 + ...`` (a shared host by its name and its roles' fields)."""
    parts: list[str] = []
    ranks = [s for s in slots if s.process.startswith("trainer-rank-") and s.gpus > 0]
    if ranks:
        parts.append(f"trainer.world_size={len(ranks)} × trainer.gpus_per_rank={ranks[0].gpus:g}")
    workers = [s for s in slots if s.roles == ("rollout",) and s.gpus > 0]
    if workers:
        own = "" if len(workers) == cfg.rollout.replicas else f" ({len(workers)} in processes of their own)"
        parts.append(f"rollout.replicas={cfg.rollout.replicas}{own} × rollout.gpus={workers[0].gpus:g}")
    for slot in slots:
        if slot.gpus <= 0 or slot in ranks or slot in workers:
            continue
        fields = [gpu_field(r) for r in slot.roles if r in GPU_ROLES]
        if len(slot.roles) == 1:
            parts.append(f"{fields[0]}={slot.gpus:g}")
        else:
            parts.append(f"{slot.process} (the largest of {', '.join(fields)}) {slot.gpus:g}")
    return " + ".join(parts)


def check_cluster(cfg: RunConfig, slots: Sequence[ProcessSlot], cluster_gpus: float) -> None:
    """The run's GPU processes fit the cluster's GPUs, and a Trainer group of several ranks over NCCL has a whole GPU
    per rank (NCCL refuses two ranks on one device; a group of one rank may take a share of a GPU).

    Raises:
        DeviceError: naming the fields, what they ask and what Ray reports.
    """
    ranks = [s for s in slots if s.process.startswith("trainer-rank-")]
    if len(ranks) > 1 and 0 < ranks[0].gpus < 1:  # one rank alone may share its GPU with other roles
        raise DeviceError(
            f"trainer.gpus_per_rank={ranks[0].gpus:g} with trainer.world_size={cfg.trainer.world_size}: the ranks of "
            "a Trainer group talk over NCCL, which needs a GPU of its own per rank; use trainer.gpus_per_rank=1"
        )
    asked = sum(s.gpus for s in slots)
    if asked > cluster_gpus + 1e-9:
        raise DeviceError(
            f"the run asks for {asked:g} GPUs ({_asked(cfg, slots)}), but Ray reports {cluster_gpus:g}; lower "
            f"rollout.replicas or a GPU count, or share devices with fractions (e.g. rollout.gpus=0.5)"
        )


@dataclass(frozen=True)
class RankPlacement:
    """Where the ranks of a Trainer group go: bundle ``r`` of ``group`` holds rank ``r``."""

    group: Any
    """The Trainer's Ray placement group."""

    gpus_per_rank: float

    def options(self, rank: int) -> dict[str, object]:
        """Ray actor options placing rank ``rank`` in its bundle."""
        return bundle_options(self.group, rank, self.gpus_per_rank)


def bundle_options(group: PlacementGroup, bundle: int, gpus: float) -> dict[str, object]:
    """Ray actor options of a process holding ``gpus`` GPUs in bundle ``bundle`` of placement group ``group``."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle)
    return {"num_gpus": gpus, "scheduling_strategy": strategy}


@dataclass
class Placement:
    """The placement groups of a GPU run and each process's slot in them."""

    slots: dict[str, ProcessSlot]
    groups: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, cfg: RunConfig, namespace: str, timeout_s: float = PLACEMENT_TIMEOUT_S) -> Placement | None:
        """The run's placement groups, placed (None on a CPU run: nothing to reserve).

        Raises:
            DeviceError: the groups could not be placed within ``timeout_s`` (:func:`check_cluster` passed, so the
                GPUs exist but not on the nodes the groups need, e.g. a ``run.placement`` resource's).
        """
        slots = run_processes(cfg)
        if not any(s.gpus > 0 for s in slots):
            return None
        import ray
        from ray.util.placement_group import placement_group

        placement = cls({s.process: s for s in slots})
        deadline = time.monotonic() + timeout_s
        # One group after the other, each placed before the next is asked for: Ray gives the free GPUs to the groups
        # in that order, so the same run on the same free GPUs gets the same ids (a dry run's are the run's).
        for group, strategy in (("trainer", "PACK"), ("roles", "SPREAD")):
            members = sorted((s for s in slots if s.group == group), key=lambda s: s.bundle)
            if not members:
                continue
            bundles = [_bundle(s) for s in members]
            placement.groups[group] = placement_group(bundles, strategy=strategy, name=f"{namespace}-{group}")
            try:
                ready, _ = ray.wait([placement.groups[group].ready()], timeout=max(0.0, deadline - time.monotonic()))
            except BaseException:
                placement.remove()
                raise
            if not ready:
                placement.remove()
                raise DeviceError(
                    f"the run's GPUs ({_asked(cfg, slots)}) could not be placed within {timeout_s:.0f} s; Ray's "
                    f"nodes hold {_node_gpus()}"
                )
        return placement

    def options(self, process: str) -> dict[str, object]:
        """Ray actor options of ``process``: its GPUs and its bundle (none for a process without GPUs)."""
        slot = self.slots.get(process)
        if slot is None or slot.group is None:
            return {}
        return bundle_options(self.groups[slot.group], slot.bundle, slot.gpus)

    def trainer_ranks(self) -> RankPlacement | None:
        """Where a Trainer group's ranks go (None: the Trainer is one process)."""
        rank = self.slots.get("trainer-rank-0")
        if rank is None or rank.group is None:
            return None
        return RankPlacement(self.groups["trainer"], rank.gpus)

    def remove(self, wait_s: float = 0.0) -> None:
        """Release the groups (their processes must be gone or going); harmless twice. ``wait_s`` > 0: return once
        Ray reports them removed (their GPUs free again), or after that many seconds."""
        from ray.util.placement_group import placement_group_table, remove_placement_group

        groups = list(self.groups.values())
        for group in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(group)
        self.groups.clear()
        deadline = time.monotonic() + wait_s
        for group in groups:
            while time.monotonic() < deadline:
                with contextlib.suppress(Exception):
                    if placement_group_table(group).get("state") == "REMOVED":
                        break
                time.sleep(0.05)


def _bundle(slot: ProcessSlot) -> dict[str, float]:
    bundle = {"GPU": slot.gpus}
    if slot.resource is not None:
        bundle[slot.resource] = 0.01
    return bundle


def _node_gpus() -> str:
    import ray

    nodes = [n for n in ray.nodes() if n.get("Alive")]  # type: ignore[no-untyped-call]
    return ", ".join(f"{n['NodeManagerAddress']}: {n['Resources'].get('GPU', 0):g} GPU" for n in nodes) or "no node"


@dataclass(frozen=True)
class SlotSite:
    """Where one process of a dry run landed."""

    node: str
    """The node's address."""
    gpu_ids: tuple[str, ...]
    """``CUDA_VISIBLE_DEVICES`` as the process sees it (empty: none)."""
    device_memory: int | None
    """Memory of its first GPU in bytes, as ``nvidia-smi`` reports it (None: no ``nvidia-smi`` on the node)."""


class _Probe:
    """A zero-CPU actor put where a run's process would go: reports its node and visible GPUs."""

    def site(self) -> SlotSite:
        import ray

        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        ids = tuple(i for i in visible.split(",") if i)
        return SlotSite(str(ray.util.get_node_ip_address()), ids, _device_memory(ids[0]) if ids else None)  # type: ignore[no-untyped-call]


def _device_memory(gpu: str) -> int | None:
    """Total memory of GPU ``gpu`` (an index or UUID of ``nvidia-smi``), bytes; None when it cannot be read."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--id={gpu}", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
        return int(float(out.strip().splitlines()[0])) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def probe_placement(cfg: RunConfig, namespace: str) -> dict[str, SlotSite | None]:
    """Where each process of the run would go, without starting it: the run's placement groups are created, a
    zero-CPU probe actor put in each GPU process's bundle reports its node and GPU ids, and the groups are removed.
    Processes without GPUs are placed freely by Ray at the run (None)."""
    import ray

    placement = Placement.create(cfg, namespace)
    sites: dict[str, SlotSite | None] = {s.process: None for s in run_processes(cfg)}
    if placement is None:
        return sites
    probes = []
    try:
        probe_cls: Any = ray.remote(_Probe)
        for name, slot in placement.slots.items():
            if slot.group is None:
                continue
            options = {"num_cpus": 0, **placement.options(name)}
            if slot.resource is not None:
                options["resources"] = {slot.resource: 0.01}
            probes.append((name, probe_cls.options(**options).remote()))
        for name, probe in probes:
            sites[name] = ray.get(probe.site.remote(), timeout=PLACEMENT_TIMEOUT_S)
    finally:
        for _, probe in probes:
            with contextlib.suppress(Exception):
                ray.kill(probe)
        placement.remove(wait_s=PLACEMENT_TIMEOUT_S)  # the run placed next on this Ray gets the same free GPUs
    return sites

"""Run-config rules of ``run.hosts`` (which roles share one process in distributed mode), kept out of ``config.py``
so that module stays the field list; light (no torch), as the config must load without the model stack."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["DEFAULT_HOSTS", "HOST_ROLES", "check_hosts", "check_hosts_placement", "host_resource"]

HOST_ROLES: tuple[str, ...] = ("trainer", "rollout", "reward", "reference", "critic", "eval")
"""The roles ``run.hosts`` may name (the services of :data:`relax_services.hosting.service_host.SERVICE_CLASSES`)."""

DEFAULT_HOSTS: tuple[tuple[str, ...], ...] = (("rollout", "reference", "eval", "reward"),)
"""The default run's hosts: the Reference, the Evaluator and the Reward in the Rollout's process, the Trainer in one
of its own. Each process that runs a model holds ≈ 400 MB of imports before any work (torch, transformers, and the
``torch._dynamo`` / sympy that transformers' masking code imports), so four model processes could not fit the
default run in 2 GB; the Trainer and the Rollout keep separate processes so that generating and training still
overlap (each holds the GIL for its Python work). The Trainer stays alone because a dead Trainer is a global restart
from the last checkpoint: a host death there would restart the run, a host death here restarts its roles in place."""


def check_hosts(hosts: Sequence[Sequence[str]]) -> list[list[str]]:
    """Validate ``run.hosts``: known roles, each in at most one host, at least two roles per host.

    Returns:
        The hosts as lists (roles in the order given).

    Raises:
        ValueError: an unknown role, a role listed twice, or a host of fewer than two roles; the message names the
            host by its index.
    """
    seen: dict[str, int] = {}
    out: list[list[str]] = []
    for index, host in enumerate(hosts):
        roles = list(host)
        if len(roles) < 2:
            raise ValueError(
                f"run.hosts[{index}]={roles}: a host shares one process between two roles or more "
                "(a role not listed has a process of its own)"
            )
        for role in roles:
            if role not in HOST_ROLES:
                raise ValueError(f"run.hosts[{index}]: unknown role {role!r}; roles are {', '.join(HOST_ROLES)}")
            if role in seen:
                raise ValueError(f"run.hosts[{index}]: role {role!r} is already in run.hosts[{seen[role]}]")
            seen[role] = index
        out.append(roles)
    return out


def check_hosts_placement(hosts: Sequence[Sequence[str]], placement: Mapping[str, str]) -> None:
    """The roles of one host run in one process, so on one node: ``run.placement`` may not pin them apart (a role of
    the host left unpinned goes where the pinned ones go, see :func:`host_resource`).

    Raises:
        ValueError: two roles of one host pinned to different resources.
    """
    for index, host in enumerate(hosts):
        pinned = {role: placement[role] for role in host if role in placement}
        if len(set(pinned.values())) > 1:
            shown = ", ".join(f"{role}: {res}" for role, res in pinned.items())
            raise ValueError(
                f"run.hosts[{index}] shares one process between {', '.join(host)}, but run.placement places them "
                f"apart ({shown}); pin the roles of one host to one resource"
            )


def host_resource(resources: Sequence[str | None]) -> str | None:
    """The Ray resource a host requires: the one its pinned members share (:func:`check_hosts_placement` allows no
    other), or None when none of them is pinned."""
    return next((resource for resource in resources if resource is not None), None)

"""``rollout.replicas``: its earlier name ``num_workers`` still loads, both at once are refused, and every replica
after the first has a process of its own (``run.hosts`` never puts two replicas together)."""

from __future__ import annotations

import pytest

from relax_core.config.base import ConfigError
from relax_services.config import load_run_config
from relax_services.hosting.placement import run_processes, service_roles


def test_num_workers_is_the_earlier_name_of_replicas() -> None:
    assert load_run_config(None, []).rollout.replicas == 1
    assert load_run_config(None, ["rollout.num_workers=3"]).rollout.replicas == 3
    assert load_run_config({"rollout": {"num_workers": 2}}, []).rollout.replicas == 2
    with pytest.raises(ConfigError, match=r"rollout.num_workers \(2\) and rollout.replicas \(3\) are one field"):
        load_run_config(None, ["rollout.num_workers=2", "rollout.replicas=3"])
    with pytest.raises(ConfigError, match=r"rollout\.replicas"):
        load_run_config(None, ["rollout.replicas=0"])


def test_each_replica_after_the_first_has_a_process_of_its_own() -> None:
    cfg = load_run_config(None, ["rollout.replicas=3"])
    names = [name for name, role in service_roles(cfg) if role == "rollout"]
    assert names == ["rollout-0", "rollout-1", "rollout-2"]
    processes = {slot.process: slot.roles for slot in run_processes(cfg)}
    # The default host keeps rollout-0 with the roles it lists; the further replicas are alone.
    hosted = [p for p in processes if p.startswith("host-")]
    assert len(hosted) == 1 and hosted[0].startswith("host-rollout-0-"), processes
    assert "rollout-1" not in hosted[0] and processes["rollout-1"] == ("rollout",) == processes["rollout-2"]


def test_a_fault_names_a_replica_the_run_has() -> None:
    cfg = load_run_config(None, ["rollout.replicas=2", "faults=[{service: rollout, replica: 1, kind: kill}]"])
    assert cfg.faults[0].replica == 1
    with pytest.raises(ConfigError, match=r"faults\[0\]\.replica=2: this run starts rollout\.replicas=2"):
        load_run_config(None, ["rollout.replicas=2", "faults=[{service: rollout, replica: 2}]"])
    with pytest.raises(ConfigError, match=r"replica=0 names a Rollout replica \(with service: rollout\)"):
        load_run_config(None, ["faults=[{service: reward, replica: 0}]"])

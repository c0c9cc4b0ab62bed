"""The chaos helpers: which roles faults may hit, seeded fault plans, and the fault table."""

from __future__ import annotations

from relax_services.chaos import chaos_targets, fault_table, random_faults
from relax_services.config import load_run_config


def test_targets_follow_the_algorithm() -> None:
    assert chaos_targets(load_run_config()) == ("rollout", "reward", "reference", "trainer")  # GRPO with a KL term
    assert chaos_targets(load_run_config(None, ["algorithm.kl_coef=0"])) == ("rollout", "reward", "trainer")
    ppo = load_run_config(None, ["algorithm.preset=ppo", "staleness.tau=0"])
    assert chaos_targets(ppo) == ("rollout", "reward", "reference", "critic", "trainer")


def test_random_faults_are_seeded_distinct_and_hit_only_the_given_roles() -> None:
    a = random_faults(6, seed=3, total_steps=40, services=("critic", "reward"))
    assert a == random_faults(6, seed=3, total_steps=40, services=("critic", "reward"))
    assert {f.service for f in a} <= {"critic", "reward"}
    steps = [f.at_step for f in a]
    assert steps == sorted(set(steps)) and steps[0] >= 2 and steps[-1] < 36


def test_fault_table_times_detection_and_recovery() -> None:
    events = [
        {"event": "injected", "service": "critic", "fault": "kill", "step": 4, "time": 10.0},
        {"event": "detected", "service": "critic", "time": 11.5},
        {"event": "restarted", "service": "critic", "time": 14.0},
        {"event": "injected", "service": "reward", "fault": "hang", "step": 9, "time": 20.0},
    ]
    table = fault_table(events, {"lost": 0, "duplicated": 0}).splitlines()
    assert table[1].split()[:5] == ["critic", "kill", "4", "1.5s", "4.0s"]
    assert table[2].split()[3:5] == ["no", "no"]  # the reward hang was never detected
    assert "all recovered: NO" in table[-1] and "prompts lost 0, duplicated 0" in table[-1]


def test_a_fault_absorbed_by_a_global_restart_counts_as_recovered() -> None:
    """The killed Reward's in-place restarts ran out, so a global restart replaced every service, it included."""
    events = [
        {"event": "injected", "service": "reward", "fault": "kill", "step": 4, "time": 10.0},
        {"event": "detected", "service": "reward", "time": 11.0},
        {"event": "global_restart", "service": "run", "time": 12.0},
        {"event": "recovered", "service": "run", "time": 30.5},
    ]
    lines = fault_table(events, {"lost": 0, "duplicated": 0}).splitlines()
    assert "replaced by a global restart" in lines[1]
    assert "20.5s" in lines[1]
    assert "all recovered: yes" in lines[-1]


def test_five_faults_hit_every_kind_and_every_default_role() -> None:
    """``relax chaos --faults 5`` on the default GRPO run (four roles) covers each kind and each role, whatever the
    seed (3 kinds and 4 roles fit in 5 faults)."""
    roles = ("rollout", "reward", "reference", "trainer")
    for seed in range(20):
        faults = random_faults(5, seed=seed, total_steps=40, services=roles)
        assert {f.kind for f in faults} == {"kill", "raise", "hang"}
        assert {f.service for f in faults} == set(roles)


def test_chaos_allows_a_global_restart_per_trainer_fault() -> None:
    """Each Trainer fault is a global restart by design: seed 1's plan of 10 faults (three on the Trainer) must not
    exhaust ``health.max_global_restarts`` (2 by default), and a larger allowance given stays."""
    from relax_services.chaos import chaos_config

    cfg = chaos_config(None, [], 10, seed=1)
    trainer_faults = sum(f.service == "trainer" for f in cfg.faults)
    assert trainer_faults == 3 and len(cfg.faults) == 10
    assert cfg.health.max_global_restarts == trainer_faults + 1
    assert chaos_config(None, ["health.max_global_restarts=9"], 10, seed=1).health.max_global_restarts == 9

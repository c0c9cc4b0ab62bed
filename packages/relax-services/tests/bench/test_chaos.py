"""The chaos helpers: which roles faults may hit, seeded fault plans, and the fault table."""

from __future__ import annotations

from relax_services.bench.chaos import chaos_targets, fault_table, random_faults
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
    from relax_services.bench.chaos import chaos_config

    cfg = chaos_config(None, [], 10, seed=1)
    trainer_faults = sum(f.service == "trainer" for f in cfg.faults)
    assert trainer_faults == 3 and len(cfg.faults) == 10
    assert cfg.health.max_global_restarts == trainer_faults + 1
    assert chaos_config(None, ["health.max_global_restarts=9"], 10, seed=1).health.max_global_restarts == 9


def test_actor_faults_kill_a_queue_then_another_actor_during_the_restart() -> None:
    from relax_services.bench.chaos import actor_faults

    for seed in range(10):
        taken = {5, 9, 17}
        faults = actor_faults(4, seed=seed, total_steps=40, taken=taken)
        assert faults == actor_faults(4, seed=seed, total_steps=40, taken=taken)  # seeded
        for mid, during in (faults[0:2], faults[2:4]):
            assert mid.service in ("prompt_queue", "sample_queue") and mid.kind == "kill" and not mid.during_restart
            assert 2 <= mid.at_step < 36 and mid.at_step not in taken
            # Armed at the same step: it lands in the global restart the queue's death brings.
            assert during.during_restart and during.kind == "kill" and during.at_step == mid.at_step
            assert during.service in ("prompt_queue", "sample_queue", "weights", "health_monitor")
    assert {f.service for s in range(30) for f in actor_faults(2, s, 40, critic=True)} >= {"critic_weights"}


def test_chaos_plans_include_actor_faults_and_allow_their_restarts() -> None:
    from relax_services.bench.chaos import chaos_config

    cfg = chaos_config(None, [], 5, seed=0, n_actor_faults=2)
    services, actors = cfg.faults[:5], cfg.faults[5:]
    assert [f.service for f in services if f.service == "trainer"] and len(actors) == 2
    assert actors[0].service.endswith("_queue") and actors[1].during_restart
    # One global restart per Trainer fault, one for the killed queue, one for the attempt the second kill
    # interrupts, and one spare.
    trainer = sum(f.service == "trainer" for f in services)
    assert cfg.health.max_global_restarts == max(2, trainer + 2 + 1)


def test_fault_table_of_actor_deaths() -> None:
    events = [
        {"event": "injected", "service": "sample_queue", "fault": "kill", "step": 6, "time": 100.0},
        {"event": "detected", "service": "sample_queue", "time": 100.4},
        {"event": "global_restart", "service": "run", "time": 100.4},
        {
            "event": "injected",
            "service": "health_monitor",
            "fault": "kill",
            "step": 6,
            "time": 107.0,
            "during_restart": True,
        },
        {"event": "detected", "service": "health_monitor", "time": 133.0},
        {"event": "global_restart", "service": "run", "time": 133.0},
        {"event": "recovered", "service": "run", "time": 175.5},
    ]
    lines = fault_table(events, {"lost": 0, "duplicated": 0}).splitlines()
    assert lines[1].split()[:5] == ["sample_queue", "kill", "6", "0.4s", "75.5s"]
    assert "global restart from the last checkpoint" in lines[1]
    assert lines[2].split()[:5] == ["health_monitor", "kill", "6", "26.0s", "68.5s"]
    assert "killed during a global restart" in lines[2]
    assert "all recovered: yes" in lines[-1]

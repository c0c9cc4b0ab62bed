"""The figures of ``relax bench trl``, from hand-made timelines (the benchmark itself is run by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_services.bench import trl as bench_trl
from relax_services.bench.trl import (
    BenchHParams,
    BenchSettings,
    SideResult,
    crossing,
    format_spread,
    format_table,
    prompt_schedule,
    relax_overrides,
    summarise,
)
from relax_services.config import load_run_config
from relax_services.reporting.footprint import UpdateSplit


def test_crossing_needs_a_full_window() -> None:
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0]
    # moving averages over 2: -, 0.5, 0.0, 0.5, 1.0, 1.0 (the lucky first update alone does not count)
    assert crossing(range(6), rewards, 0.8, window=2) == 4
    assert crossing(range(6), rewards, 0.5, window=2) == 1
    assert crossing(range(6), rewards, 1.01, window=2) is None
    assert crossing(range(1), [1.0], 0.5, window=2) is None


def test_summarise_from_one_clock() -> None:
    start = 1000.0
    times = [start + 5.0 + 0.5 * i for i in range(30)]
    # first update 5 s after the command, then every 0.5 s
    rewards = [0.0] * 10 + [1.0] * 20
    side = SideResult("x", start, times, rewards, samples=64, peak_bytes=2_500_000_000, wall_s=21.0)
    figures = summarise(side)
    assert figures["startup_s"] == pytest.approx(5.0)
    assert figures["s_per_update"] == pytest.approx(0.5)
    assert figures["samples_per_s"] == pytest.approx(128.0)
    # moving average over 10 reaches 0.8 when 8 of the last 10 are 1: update index 17 (the 18th update)
    assert figures["updates_to_0.8"] == 18
    assert figures["wall_to_0.8"] == pytest.approx(5.0 + 0.5 * 17)
    stalled_times = times[:3] + [t + 100.0 for t in times[3:]]  # a 100 s stall after the third update
    stalled = summarise(SideResult("x", start, stalled_times, rewards, samples=64))
    assert stalled["wall_to_0.8"] == pytest.approx(5.0 + 0.5 * 17 + 100.0)
    assert stalled["paced_to_0.8"] == pytest.approx(5.0 + 0.5 * 17)
    assert figures["updates_to_0.5"] == 15
    assert figures["final_reward"] == pytest.approx(1.0)
    assert figures["peak_gb"] == pytest.approx(2.5)


def test_table_shows_ratios_to_the_first_side() -> None:
    times_a = [10.0 + i for i in range(20)]
    times_b = [5.0 + 0.5 * i for i in range(20)]
    a = SideResult("A", 0.0, times_a, [0.0] * 20, samples=8, peak_bytes=10**9, wall_s=30.0)
    b = SideResult("B", 0.0, times_b, [0.0] * 20, samples=8, peak_bytes=2 * 10**9, wall_s=15.0)
    table = format_table([a, b])
    assert "| command → first update | 10.0s | 5.0s (0.50×) |" in table
    assert "| median seconds per update | 1.0s | 0.500s (0.50×) |" in table
    assert "| samples/s | 8 | 16 (2.00×) |" in table
    assert "| peak PSS of the process tree | 1.00 GB | 2.00 GB (2.00×) |" in table
    assert "not reached" in table


def _hparams(seed: int) -> BenchHParams:
    return {
        "updates": 400,
        "seed": seed,
        "group_size": 8,
        "groups_per_step": 16,
        "max_new_tokens": 1,
        "temperature": 1.0,
        "lr": 1e-3,
        "grad_clip": 1.0,
        "clip_eps": 0.2,
        "suppressed_ids": [0, 1],
        "intra_op_threads": 1,
    }


def test_relax_side_takes_the_bench_seed_for_sampling_and_prompt_order(tmp_path: Path) -> None:
    # TRL's seed drives both its sampling and its prompt sampler, so relax's side must seed both too: before, only
    # trainer.seed followed --seed and every seed drew the prompts in data.seed 0's order.
    cfg = load_run_config(None, relax_overrides(tmp_path, _hparams(3), tau=0))
    assert cfg.trainer.seed == 3
    assert cfg.data.seed == 3
    assert cfg.staleness.tau == 0
    assert cfg.optimizer.lr == pytest.approx(1e-3)
    assert cfg.optimizer.schedule == "constant"
    assert cfg.optimizer.weight_decay == 0.0  # TRL's side sets weight_decay=0.0
    assert cfg.algorithm.kl_coef == 0.0 and cfg.algorithm.entropy_coef == 0.0


def test_shared_hyper_parameters_carry_relax_thread_count(tmp_path: Path) -> None:
    # relax pins one intra-op thread per role; the TRL side ran at torch's default (one per core) until the count
    # travelled with the shared hyper-parameters (the side script sets it with torch.set_num_threads).
    from relax_services.engines._threads import DEFAULT_INTRA_OP_THREADS
    from relax_services.models import open_checkpoint

    bench_trl._write_model(tmp_path, seed=0)
    hp = bench_trl._hparams(400, 0, tmp_path)
    assert hp["intra_op_threads"] == DEFAULT_INTRA_OP_THREADS == 1
    assert hp["suppressed_ids"] == list(open_checkpoint(tmp_path / "model").tokens.never_sample)


def _side(name: str, first_one: int | None, n: int = 40) -> SideResult:
    """A side whose reward is 0 before update ``first_one`` (0-based) and 1 from it on (None: never)."""
    rewards = [0.0 if first_one is None or i < first_one else 1.0 for i in range(n)]
    return SideResult(name, 0.0, [float(i) for i in range(n)], rewards, samples=8)


def test_spread_lists_each_seed_and_the_median_with_never_as_infinite() -> None:
    # Rewards step 0 -> 1 at update k: the 10-update moving average reaches 0.3 / 0.5 / 0.8 once 3 / 5 / 8 ones are
    # in the window, i.e. at the (k + 3)-th / (k + 5)-th / (k + 8)-th update.
    by_seed = {
        0: [_side("A", 10), _side("B", 20)],
        1: [_side("A", 12), _side("B", None)],
        2: [_side("A", 30), _side("B", None)],
    }
    lines = format_spread(by_seed).splitlines()
    assert lines[0] == "| seed | A: updates to 0.3 / 0.5 / 0.8 | B: updates to 0.3 / 0.5 / 0.8 |"
    assert lines[2] == "| 0 | 13 / 15 / 18 | 23 / 25 / 28 |"
    assert lines[3] == "| 1 | 15 / 17 / 20 | — / — / — |"
    assert lines[4] == "| 2 | 33 / 35 / 38 | — / — / — |"
    # A: medians of (13, 15, 33), (15, 17, 35), (18, 20, 38); B: two of three never reached -> never
    assert lines[5] == "| median | 15 / 17 / 20 | — / — / — |"


def test_prompt_schedule_takes_distinct_prompts_of_a_fresh_permutation_per_update() -> None:
    order = prompt_schedule(25, 16, 400, seed=3)
    assert len(order) == 400 * 16
    blocks = [order[i : i + 16] for i in range(0, len(order), 16)]
    assert all(len(set(b)) == 16 and set(b) <= set(range(25)) for b in blocks)  # 16 distinct prompts an update
    assert len({tuple(b) for b in blocks}) > 390  # fresh draws, not one block repeated
    # Each prompt is in an update with probability 16/25: 256 of 400 expected, binomial std 9.6.
    counts = [order.count(i) for i in range(25)]
    assert all(200 < c < 312 for c in counts)
    assert prompt_schedule(25, 16, 400, seed=3) == order
    assert prompt_schedule(25, 16, 400, seed=4) != order
    whole = prompt_schedule(3, 3, 10, seed=0)  # an update of every prompt: each block a permutation
    assert all(sorted(whole[i : i + 3]) == [0, 1, 2] for i in range(0, 30, 3))
    with pytest.raises(ValueError, match="per_update"):
        prompt_schedule(25, 26, 1, seed=0)


def test_command_line_passes_the_seed_and_the_seed_list(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from relax_services import cli

    calls: list[tuple[object, ...]] = []

    def record(
        work: Path, updates: int, taus: list[int], seed: int = 0, seeds: list[int] | None = None, **_: object
    ) -> int:
        calls.append((work, updates, taus, seed, seeds))
        return 0

    monkeypatch.setattr(bench_trl, "run_trl_bench", record)
    assert cli.main(["bench", "trl", "--work", str(tmp_path), "--seed", "3", "--taus", "0"]) == 0
    assert cli.main(["bench", "trl", "--work", str(tmp_path), "--seeds", "0,1,2", "--updates", "50"]) == 0
    assert calls == [(tmp_path, 400, [0], 3, []), (tmp_path, 50, [0, 2], 0, [0, 1, 2])]


def test_command_line_passes_the_distributed_sides_and_the_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from relax_services import cli

    calls: list[dict[str, object]] = []

    def record(work: Path, updates: int, taus: list[int], **kw: object) -> int:
        calls.append({"taus": taus, **kw})
        return 0

    monkeypatch.setattr(bench_trl, "run_trl_bench", record)
    assert cli.main(["bench", "trl", "--work", str(tmp_path)]) == 0
    argv = ["--taus", "", "--distributed-taus", "1,2", "--lr", "5e-4", "--group-size", "16", "--groups-per-step", "8"]
    assert cli.main(["bench", "trl", "--work", str(tmp_path), *argv]) == 0
    assert calls[0]["distributed_taus"] == [2]
    assert calls[0]["settings"] == BenchSettings()
    assert calls[1]["taus"] == []
    assert calls[1]["distributed_taus"] == [1, 2]
    assert calls[1]["settings"] == BenchSettings(lr=5e-4, group_size=16, groups_per_step=8)


def test_distributed_side_differs_from_the_colocated_one_only_in_mode_and_name(tmp_path: Path) -> None:
    hp = _hparams(1)
    colocated = relax_overrides(tmp_path, hp, tau=2)
    distributed = relax_overrides(tmp_path, hp, tau=2, mode="distributed")
    changed = sorted(set(distributed) - set(colocated))
    assert changed == ["run.mode=distributed", "run.name=relax-distributed-tau2"]
    cfg = load_run_config(None, distributed)
    assert cfg.run.mode == "distributed"
    assert cfg.staleness.tau == 2
    with pytest.raises(ValueError, match="mode must be one of"):
        relax_overrides(tmp_path, hp, tau=2, mode="fused")


def test_settings_reach_both_sides_and_bad_ones_name_the_field(tmp_path: Path) -> None:
    bench_trl._write_model(tmp_path, seed=0)
    settings = BenchSettings(lr=3e-4, group_size=16, groups_per_step=8)
    hp = bench_trl._hparams(100, 0, tmp_path, settings)
    assert (hp["lr"], hp["group_size"], hp["groups_per_step"]) == (3e-4, 16, 8)
    cfg = load_run_config(None, relax_overrides(tmp_path, hp, tau=0))
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.algorithm.group_size == 16
    assert cfg.trainer.groups_per_step == 8 and cfg.rollout.groups_per_call == 8
    with pytest.raises(ValueError, match="group_size"):
        BenchSettings(group_size=1)
    with pytest.raises(ValueError, match="groups_per_step"):
        BenchSettings(groups_per_step=26)
    with pytest.raises(ValueError, match="lr"):
        BenchSettings(lr=0.0)


def test_table_shows_relax_per_update_split_and_a_dash_for_trl() -> None:
    times = [float(i) for i in range(20)]
    trl = SideResult("TRL", 0.0, times, [0.0] * 20, samples=8)
    split = UpdateSplit(20, 0.08, 0.02, 0.01, 0.005, 0.15, 0.035)
    relax = SideResult("relax", 0.0, times, [0.0] * 20, samples=8, split=split)
    table = format_table([trl, relax])
    assert "| relax trainer: interval between updates | — | 0.150s |" in table
    assert "|   compute (batch, forward, backward, step) | — | 0.080s |" in table
    assert "|   queue calls besides the get (ack + version) | — | 0.005s |" in table
    assert "|   outside these (record, loop, GIL) | — | 0.035s |" in table
    assert "relax trainer" not in format_table([trl, trl])  # no relax side, no split rows


def test_spread_also_gives_wall_seconds_ratios_of_medians_and_counts_of_runs_reaching() -> None:
    # Side A's rewards step 0 -> 1 at update 10, 12, 30 (seeds 0, 1, 2), B's at 20, never, never; updates 1 s apart
    # from t = 0 with the command at 0, so the wall seconds to a threshold are the update index: (k + 2), (k + 4),
    # (k + 7) for 0.3 / 0.5 / 0.8.
    by_seed = {
        0: [_side("A", 10), _side("B", 20)],
        1: [_side("A", 12), _side("B", None)],
        2: [_side("A", 30), _side("B", None)],
    }
    lines = format_spread(by_seed).splitlines()
    assert lines[6] == "| median ratio to the first side | 1.00× / 1.00× / 1.00× | — / — / — |"
    wall = lines[lines.index("") + 1 :]
    assert wall[0] == "| seed | A: wall s to 0.3 / 0.5 / 0.8 | B: wall s to 0.3 / 0.5 / 0.8 |"
    assert wall[2] == "| 0 | 12 / 14 / 17 | 22 / 24 / 27 |"
    assert wall[5] == "| median | 14 / 16 / 19 | — / — / — |"  # A: medians of (12, 14, 32), (14, 16, 34), ...
    assert wall[7] == "| runs that reached it | 3 of 3 / 3 of 3 / 3 of 3 | 1 of 3 / 1 of 3 / 1 of 3 |"
    two = {s: [_side("A", 10 + s), _side("B", 8 + s)] for s in (0, 1)}
    ratio_lines = [x for x in format_spread(two).splitlines() if x.startswith("| median ratio")]
    # updates to 0.3 / 0.5 / 0.8 are k + 3, k + 5, k + 8: A's medians over k = 10, 11 are 13.5 / 15.5 / 18.5, B's
    # over k = 8, 9 are 11.5 / 13.5 / 16.5
    want = f"{11.5 / 13.5:.2f}× / {13.5 / 15.5:.2f}× / {16.5 / 18.5:.2f}×"
    assert ratio_lines[0] == f"| median ratio to the first side | 1.00× / 1.00× / 1.00× | {want} |"

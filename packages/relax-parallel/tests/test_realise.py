"""Realisation: DeviceMesh groups on 4 gloo processes, pure rank groups, megatron-core arguments."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from relax_parallel import MEGATRON_ORDER, ParallelConfig, ParallelPlan

WORLD = 4
CONFIGS: list[dict[str, int]] = [
    {"tp": 2, "dp": 2},
    {"tp": 2, "cp": 2},
    {"pp": 2, "tp": 2},
    {"pp": 2, "dp": 2},
    {"cp": 2, "dp": 2, "ep": 2},
    {"cp": 4, "ep": 4},
]


def _coords(rank: int, c: ParallelConfig) -> dict[str, int]:
    """Megatron's order tp-cp-ep-dp-pp: rank = tp_i + tp·(cp_i + cp·(dp_i + dp·pp_i))."""
    return {
        "tp": rank % c.tp,
        "cp": rank // c.tp % c.cp,
        "dp": rank // (c.tp * c.cp) % c.dp,
        "pp": rank // (c.tp * c.cp * c.dp),
    }


def _expert_coords(rank: int, c: ParallelConfig) -> dict[str, int]:
    """Expert ranks, order tp-ep-dp-pp with expert tp = tp."""
    return {
        "tp": rank % c.tp,
        "ep": rank // c.tp % c.ep,
        "edp": rank // (c.tp * c.ep) % c.expert_dp,
        "pp": rank // (c.tp * c.expert_dp * c.ep),
    }


Coords = Callable[[int, ParallelConfig], dict[str, int]]


def _expected(rank: int, dim: str, c: ParallelConfig, coords: Coords = _coords) -> list[int]:
    mine = coords(rank, c)
    return [r for r in range(c.world_size) if all(v == mine[k] for k, v in coords(r, c).items() if k != dim)]


@pytest.mark.parametrize("kwargs", CONFIGS)
def test_rank_groups_match_megatron_order(kwargs: dict[str, int]) -> None:
    cfg = ParallelConfig(**kwargs)
    groups = ParallelPlan.from_config(cfg).rank_groups()
    for dim in ("tp", "cp", "dp", "pp"):
        expected = {tuple(_expected(r, dim, cfg)) for r in range(WORLD)}
        assert {tuple(g) for g in groups[dim]} == expected, dim
    for dim in ("ep", "edp"):
        expected = {tuple(_expected(r, dim, cfg, _expert_coords)) for r in range(WORLD)}
        assert {tuple(g) for g in groups[dim]} == expected, dim


@pytest.mark.integration
def test_device_mesh_groups_on_four_gloo_processes(tmp_path: Path) -> None:
    worker = Path(__file__).with_name("_gloo_worker.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(rank), str(WORLD), str(tmp_path), json.dumps(CONFIGS)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(WORLD)
    ]
    try:
        errors = [p.communicate(timeout=240)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), "\n".join(e[-2000:] for e in errors)
    for rank in range(WORLD):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kwargs, entry in zip(CONFIGS, results, strict=True):
            cfg = ParallelConfig(**kwargs)
            for dim, got in entry["dense"].items():
                want = _expected(rank, dim, cfg)
                assert got["ranks"] == want, (kwargs, rank, dim)
                assert got["sum"] == sum(want)
            if cfg.ep > 1:
                for dim in ("ep", "edp", "tp"):
                    want = _expected(rank, dim, cfg, _expert_coords)
                    assert entry["expert"][dim]["ranks"] == want, (kwargs, rank, dim)


def test_megatron_kwargs_values() -> None:
    kwargs = ParallelPlan.from_config(ParallelConfig(tp=2, pp=2, cp=2, dp=2, ep=4)).megatron_kwargs()
    assert kwargs == {
        "tensor_model_parallel_size": 2,
        "pipeline_model_parallel_size": 2,
        "context_parallel_size": 2,
        "expert_model_parallel_size": 4,
        "expert_tensor_parallel_size": 2,
        "order": MEGATRON_ORDER,
    }


def test_megatron_kwargs_bind_to_initialize_model_parallel() -> None:
    parallel_state = pytest.importorskip(
        "megatron.core.parallel_state", reason="megatron-core not installed (extra relax-parallel[megatron])"
    )
    kwargs = ParallelPlan.from_config(ParallelConfig(tp=2, pp=2)).megatron_kwargs()
    inspect.signature(parallel_state.initialize_model_parallel).bind(**kwargs)

"""The GPU check (``scripts/gpu_check.sh``): its CPU mode end to end, checked against the run's ``metrics.jsonl``
read here on its own; the summary of hand-written metric records; the junit counts; the layouts and overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from relax_services.bench.gpu_check import (
    QWEN25_05B_SHAPE,
    RolloutEngine,
    layouts,
    main,
    parse_junit,
    train_overrides,
)
from relax_services.bench.gpu_report import passed, summarize_metrics
from relax_services.config import load_run_config

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"

# The tiny Qwen2 (vocabulary 64, hidden 64, FFN 128, 2 layers, 4 heads of 16, 2 KV heads, untied embeddings):
# embedding and LM head 2 × 64·64; per layer q 64·64+64, k and v 64·32+32 each, o 64·64, MLP 3·64·128, 2 norms of
# 64; the final norm 64.
TINY_QWEN2_PARAMETERS = 2 * 64 * 64 + 2 * (4160 + 2 * 2080 + 4096 + 3 * 64 * 128 + 2 * 64) + 64


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("gpu_check") / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    return proc, out


def test_cpu_mode_writes_a_report_consistent_with_the_run(
    cpu_check: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, out = cpu_check
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text(encoding="utf-8"))
    assert report["device"] == "cpu" and report["tests"]["ran"] is False
    assert report["model"]["parameters"] == TINY_QWEN2_PARAMETERS
    [run] = report["layouts"]
    assert report["layouts_skipped"] == []
    assert run["returncode"] == 0 and run["error"] is None and "trainer.total_steps=2" in run["command"]
    assert "run.device=cpu" in run["command"]
    figures = run["figures"]
    assert figures["error"] is None and figures["stop_reason"] == "total_steps reached"

    records = _records(Path(run["run_dir"]) / "metrics.jsonl")
    train = sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])
    assert figures["updates"] == max(r["step"] for r in train) >= 2
    span = train[-1]["time"] - train[0]["time"]
    assert figures["train_span_s"] == pytest.approx(span)
    assert figures["samples_per_s"] > 0
    assert figures["samples_per_s"] == pytest.approx(sum(r["samples"] for r in train[1:]) / span)
    assert figures["tokens_per_s"] == pytest.approx(sum(r["tokens"] for r in train[1:]) / span)
    published = figures["weight_sync"]["trainer"]
    assert [p["version"] for p in published] == [r["step"] for r in train]
    for entry, record in zip(published, train, strict=True):
        assert entry["bytes"] == 4 * TINY_QWEN2_PARAMETERS  # float32 weights
        assert entry["publish_s"] == pytest.approx(record["weight_sync_s"])
    mismatch = {r["step"]: r["rollout_mismatch_kl"] for r in train if "rollout_mismatch_kl" in r}
    got = figures["rollout_mismatch_kl"]
    assert {m["version"]: m["kl"] for m in (got["per_update"] if got else [])} == mismatch
    assert figures["device_peak_mib"] is None and figures["device_memory_note"].startswith("not recorded")
    assert f"{figures['updates']} updates" in proc.stdout and "gpu_check.json" in proc.stdout


def test_out_must_be_empty(tmp_path: Path) -> None:
    (tmp_path / "kept").write_text("x")
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--out", str(tmp_path)], capture_output=True, text=True, env=env
    )
    assert proc.returncode == 2 and "empty or new folder" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept"]


def _write(path: Path, records: list[dict[str, Any]], torn: str = "") -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn, encoding="utf-8")
    return path


def test_summary_of_hand_written_records(tmp_path: Path) -> None:
    gb = 2_000_000_000
    records = [
        {"kind": "plan", "wall": 1.0, "service": "trainer", "text": "..."},
        {"kind": "train", "wall": 5.0, "time": 100.0, "service": "trainer", "step": 1, "samples": 16, "tokens": 40.0,
         "weight_sync_s": 0.5, "weight_sync_bytes": gb, "rollout_mismatch_kl": 0.002},
        {"kind": "rollout", "wall": 5.5, "service": "rollout-0", "tokens": 100, "seconds": 2.0,
         "weight_sync_s": {"1": 0.5}, "weight_load_s": {"1": 0.5}},
        {"kind": "train", "wall": 7.0, "time": 102.0, "service": "trainer", "step": 2, "samples": 16, "tokens": 60.0,
         "weight_sync_s": 0.25, "weight_sync_bytes": gb},
        {"kind": "device_memory", "wall": 7.1, "service": "trainer", "peak_mib": 1000.0, "reserved_mib": 1100.0},
        {"kind": "device_memory", "wall": 7.2, "service": "trainer", "peak_mib": 1500.0, "reserved_mib": 1600.0},
        {"kind": "device_memory", "wall": 7.3, "service": "rollout-0", "peak_mib": 800.0, "reserved_mib": 900.0},
        {"kind": "eval", "wall": 7.4, "service": "eval", "version": 2, "reward": {}, "device_peak_mib": 300.0},
        {"kind": "rollout", "wall": 8.5, "service": "rollout-0", "tokens": 50, "seconds": 0.5,
         "weight_sync_s": {"3": 0.2}, "weight_load_s": {"3": 0.3}},
        {"kind": "train", "wall": 9.0, "time": 104.0, "service": "trainer", "step": 3, "samples": 8, "tokens": 20.0,
         "weight_sync_s": 1.0, "weight_sync_bytes": gb, "rollout_mismatch_kl": 0.004},
        {"kind": "summary", "wall": 10.0, "stop_reason": "total_steps reached"},
    ]  # fmt: skip
    got = summarize_metrics(_write(tmp_path / "metrics.jsonl", records, torn='{"kind": "tra'))
    assert got["updates"] == 3 and got["first_update_wall_s"] == 5.0
    assert got["train_span_s"] == 4.0  # trainer clock 100 → 104
    assert got["samples_per_s"] == pytest.approx((16 + 8) / 4.0)  # updates after the first
    assert got["tokens_per_s"] == pytest.approx((60 + 20) / 4.0)
    assert got["rollout_tokens_per_s"] == pytest.approx(150 / 2.5)
    sync = got["weight_sync"]
    assert [p["gb_per_s"] for p in sync["trainer"]] == pytest.approx([4.0, 8.0, 2.0])  # 2 GB in 0.5, 0.25, 1 s
    assert sync["publish_s_median"] == 0.5 and sync["publish_gb_per_s_median"] == pytest.approx(4.0)
    assert [(r["version"], r["gb_per_s"]) for r in sync["rollout"]] == [
        (1, pytest.approx(2.0)),
        (3, pytest.approx(4.0)),
    ]
    assert sync["rollout_gb_per_s_median"] == pytest.approx(3.0) and sync["note"] is None
    assert got["device_peak_mib"] == {"trainer": 1500.0, "rollout-0": 800.0, "eval": 300.0}
    assert got["device_reserved_mib"] == {"trainer": 1600.0, "rollout-0": 900.0}
    assert got["device_memory_note"] is None
    mismatch = got["rollout_mismatch_kl"]
    assert mismatch["per_update"] == [{"version": 1, "kl": 0.002}, {"version": 3, "kl": 0.004}]
    assert mismatch["mean"] == pytest.approx(0.003) and mismatch["max"] == 0.004
    assert (got["stop_reason"], got["error"]) == ("total_steps reached", None)


def test_summary_says_what_the_records_lack(tmp_path: Path) -> None:
    records = [
        {"kind": "train", "wall": 5.0, "time": 100.0, "service": "trainer", "step": 1, "samples": 16, "tokens": 4.0,
         "weight_sync_s": 0.5},
        {"kind": "summary", "wall": 6.0, "stop_reason": "gave up", "error": "the trainer failed"},
    ]  # fmt: skip
    got = summarize_metrics(_write(tmp_path / "metrics.jsonl", records))
    assert got["updates"] == 1 and got["samples_per_s"] is None and got["tokens_per_s"] is None  # one update: no span
    assert got["rollout_tokens_per_s"] is None and got["rollout_mismatch_kl"] is None
    assert got["weight_sync"]["trainer"] == [{"version": 1, "publish_s": 0.5, "bytes": None, "gb_per_s": None}]
    assert "weight_sync_bytes" in got["weight_sync"]["note"]
    assert got["device_peak_mib"] is None and got["device_memory_note"].startswith("not recorded")
    assert got["error"] == "the trainer failed"


def test_a_record_of_another_type_is_named(tmp_path: Path) -> None:
    record = {"kind": "train", "wall": 1.0, "time": 1.0, "step": 1, "samples": "16", "tokens": 4.0, "weight_sync_s": 0}
    with pytest.raises(ValueError, match=r"kind 'train': samples='16' is not a number"):
        summarize_metrics(_write(tmp_path / "metrics.jsonl", [record]))


def test_the_check_passes_only_without_failures() -> None:
    counts = {"passed": 3, "failed": 0, "skipped": 6, "errors": 0, "failed_tests": []}
    report: Any = {"tests": {"ran": True, "counts": counts}, "layouts": [{"returncode": 0}]}
    assert passed(report)
    assert not passed({**report, "layouts": [{"returncode": 0}, {"returncode": None}]})  # a run at its time limit
    assert not passed({**report, "tests": {"ran": True, "counts": {**counts, "errors": 1}}})
    assert not passed({**report, "tests": {"ran": True, "counts": None}})  # pytest wrote no junit xml
    assert passed({**report, "tests": {"ran": False, "counts": None}})  # the CPU mode runs no tests


def test_junit_counts(tmp_path: Path) -> None:
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<?xml version="1.0"?><testsuites><testsuite tests="6">'
        '<testcase classname="a" name="ok1"/><testcase classname="a" name="ok2"><system-out>x</system-out></testcase>'
        '<testcase classname="a" name="bad"><failure message="boom"/></testcase>'
        '<testcase classname="b" name="broken"><error message="setup"/></testcase>'
        '<testcase classname="b" name="s1"><skipped message="needs a CUDA GPU"/></testcase>'
        '<testcase classname="b" name="s2"><skipped message="needs a CUDA GPU"/></testcase>'
        "</testsuite></testsuites>",
        encoding="utf-8",
    )
    assert parse_junit(xml) == {
        "passed": 2, "failed": 1, "skipped": 2, "errors": 1, "failed_tests": ["a::bad", "b::broken"]
    }  # fmt: skip


def _gpus_asked(overrides: tuple[str, ...]) -> float:
    """GPUs a layout reserves: the Trainer's, plus its Rollout process's, which holds the Reference and the
    Evaluator (the default ``run.hosts``) and reserves the largest of the three."""
    counts = {o.split("=")[0]: float(o.split("=")[1]) for o in overrides if "gpus" in o}
    host = max(counts["rollout.gpus"], counts["reference.gpus"], counts["eval.gpus"])
    return counts["trainer.gpus_per_rank"] + host


def test_layouts_fit_the_gpus_listed() -> None:
    one, skipped = layouts("cuda", 1)
    assert [layout.name for layout in one] == ["one-process", "colocated", "fsdp"]
    assert [s["name"] for s in skipped] == ["split"]
    assert all(_gpus_asked(layout.overrides) <= 1 for layout in one[1:])
    two, skipped = layouts("cuda", 2)
    assert [layout.name for layout in two] == ["one-process", "colocated", "fsdp", "split"] and skipped == []
    assert _gpus_asked(two[3].overrides) == 2
    picked, skipped = layouts("cuda", 1, "hf", ["split", "colocated"])
    assert [layout.name for layout in picked] == ["colocated"] and [s["name"] for s in skipped] == ["split"]
    assert not any("vllm" in o for o in picked[0].overrides)
    with pytest.raises(ValueError, match=r"unknown layout.*ring"):
        layouts("cuda", 1, "hf", ["ring"])


def test_cpu_overrides_are_a_valid_run_config(tmp_path: Path) -> None:
    overrides = train_overrides("cpu", tmp_path / "model", tmp_path)
    [layout], _ = layouts("cpu", 0)
    cfg = load_run_config(None, [*overrides, *layout.overrides])
    assert cfg.trainer.total_steps == 2 and cfg.run.mode == "colocated" and cfg.data.tasks == ["text"]


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_cuda_overrides_are_a_valid_run_config(tmp_path: Path, engine: RolloutEngine) -> None:
    overrides = train_overrides("cuda", tmp_path / "model", tmp_path, engine)
    for layout in layouts("cuda", 2, engine)[0]:
        cfg = load_run_config(None, [*overrides, *layout.overrides])
        assert cfg.trainer.total_steps == 20 and cfg.rollout.engine == engine and cfg.run.device == "cuda"
        assert (cfg.run.mode == "colocated") == (layout.name == "one-process")
        assert (cfg.trainer.engine == "fsdp") == (layout.name == "fsdp")
    cfg = load_run_config(None, train_overrides("cuda", tmp_path / "model", tmp_path, engine, updates=6))
    assert cfg.trainer.total_steps == 6 and cfg.eval.every_steps == 3


def test_bad_layout_or_updates_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--out", str(tmp_path / "a"), "--layouts", "colocated,ring"]) == 2
    assert "unknown ring" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "b"), "--updates", "0"]) == 2
    assert "--updates 0 is below 1" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_shape_is_qwen25_05b() -> None:
    """With the published vocabulary the shape has Qwen2.5-0.5B's published parameter counts (its model card: 0.49 B
    in all, 0.36 B without the tied embedding). Per layer: q 896·896+896, k and v 896·128+128 each, o 896·896, MLP
    3·896·4864, 2 norms of 896; then the final norm and one embedding of vocabulary × 896."""
    import torch
    import transformers

    layers = 24 * (896 * 896 + 896 + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896) + 896
    for vocab in (151936, 64):  # the published vocabulary, the tiny tokenizer's
        with torch.device("meta"):
            model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=vocab, **QWEN25_05B_SHAPE))
        assert sum(p.numel() for p in model.parameters()) == layers + vocab * 896
    assert round((layers + 151936 * 896) / 1e9, 2) == 0.49 and round(layers / 1e9, 2) == 0.36

"""relax-plan: the issue's question end to end, and errors as exit status 2."""

from __future__ import annotations

import pytest

from relax_parallel.cli import main


def test_omni_16_gpus_30pct_video(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "qwen2.5-omni-7b", "--gpus", "16", "--gpu-mem", "80", "--video", "0.3"]) == 0
    out = capsys.readouterr().out
    assert "text 70%, video 30%" in out
    assert "[trainer] 16 GPUs" in out
    assert "binding" in out and "video" in out
    assert "service split" in out and "[rollout]" in out


def test_text_only_without_split(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "qwen2-7b", "--gpus", "8", "--no-split"]) == 0
    out = capsys.readouterr().out
    assert "[trainer] 8 GPUs: tp=1 pp=1 cp=1" in out and "service split" not in out


def test_infeasible_and_invalid_requests_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "qwen2.5-omni-7b", "--gpus", "2", "--gpu-mem", "24", "--video", "0.3"]) == 2
    assert "GiB over" in capsys.readouterr().err
    assert main(["--model", "qwen2-7b", "--gpus", "8", "--video", "0.7", "--audio", "0.6"]) == 2
    assert "sum to" in capsys.readouterr().err
    assert main(["--model", "no-such-model", "--gpus", "8"]) == 2
    assert "not a preset" in capsys.readouterr().err

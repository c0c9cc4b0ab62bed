"""`relax train` / `relax chaos` argument and config errors: reported before any heavy import and before Ray
(checked by what the CLI process has imported when it returns, not by timing), naming the field, with nothing
created on disk."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from relax_core import ConfigError
from relax_services.cli import build_parser, main
from relax_services.config import load_run_config
from relax_services.config.resume import resume_config

_PROBE = """
import json, sys
from relax_services.cli import main
try:
    rc = main(sys.argv[1:])
except SystemExit as exc:  # argparse usage errors
    rc = exc.code
heavy = [m for m in ("torch", "transformers", "ray") if m in sys.modules]
print(json.dumps({"rc": rc, "heavy": heavy}))
"""


def _cli(*args: str) -> tuple[dict[str, object], str]:
    probe, _, err = _cli_output(*args)
    return probe, err


def _cli_output(*args: str) -> tuple[dict[str, object], str, str]:
    """The probe's answer, the CLI's stdout before it, and its stderr."""
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], capture_output=True, text=True, timeout=300)
    lines = proc.stdout.strip().splitlines()
    return json.loads(lines[-1]), "\n".join(lines[:-1]), proc.stderr


@pytest.mark.parametrize(
    ("override", "field", "words"),
    [
        ("data.data_dir={missing}", "data.data_dir", "no such folder"),
        ("model.source={missing}", "model.source", "no such folder"),
        ("reward.name=no_such_reward", "reward.name", "unknown reward"),
        ("reward.name=no_such_pkg.rewards:score", "reward.name", "cannot find module"),
        ("data.train_files={missing}.parquet", "data.train_files", "no such file or folder"),
        ("reward.fn={missing}.py:score", "reward.fn", "no such file"),
        ("reward.fn=no_such_pkg.rewards:score", "reward.fn", "cannot find module"),
        ("rollout.env={missing}.py:Env", "rollout.env", "no such file"),
        ("rollout.env=no_such_pkg.envs:Env", "rollout.env", "cannot find module"),
        ("rollout.agent={missing}.py:run", "rollout.agent", "no such file"),
        ("staleness.tau=-1", "staleness.tau", ">= 0"),
        ("trainer.micro_batch_groups=64", "trainer.micro_batch_groups=64", "trainer.groups_per_step=32"),
    ],
)
def test_bad_paths_names_and_values_fail_before_heavy_imports(
    tmp_path: Path, override: str, field: str, words: str
) -> None:
    missing = tmp_path / "typo"
    result, err = _cli("train", override.format(missing=missing), f"run.output_dir={tmp_path / 'runs'}")
    assert result == {"rc": 2, "heavy": []}, err
    assert field in err and words in err, err
    assert "Traceback" not in err and "<root>" not in err and "{" not in err  # no raw dict of the whole input
    assert not missing.exists() and not (tmp_path / "runs").exists()  # nothing created


def test_unusable_output_dir_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    result, err = _cli("train", f"run.output_dir={blocker}")
    assert result == {"rc": 2, "heavy": []}, err
    assert "run.output_dir" in err and "is a file" in err and "Traceback" not in err


def test_resume_of_a_run_that_never_ran(tmp_path: Path) -> None:
    result, err = _cli("train", f"run.output_dir={tmp_path}", "run.name=never", "--resume", "trainer.total_steps=5")
    assert result == {"rc": 2, "heavy": []}, err
    assert "--resume: no run folder" in err and not (tmp_path / "never").exists()
    (tmp_path / "empty").mkdir()
    result, err = _cli("train", f"run.output_dir={tmp_path}", "run.name=empty", "--resume")
    assert result == {"rc": 2, "heavy": []}, err
    assert "no complete checkpoint" in err and "without --resume" in err


def test_chaos_bad_arguments_are_usage_errors(tmp_path: Path) -> None:
    result, err = _cli("chaos", "--faults", "-1")
    assert result["rc"] == 2 and "--faults" in err and "Traceback" not in err
    result, err = _cli("chaos", "staleness.tau=-1", f"run.output_dir={tmp_path}")
    assert result == {"rc": 2, "heavy": []}, err
    assert "staleness.tau" in err and "Traceback" not in err and not any(tmp_path.iterdir())


def test_resume_flag_may_stand_between_overrides() -> None:
    parser = build_parser()
    args, extra = parser.parse_known_args(["train", "run.name=r", "--resume", "trainer.total_steps=200"])
    assert args.resume and extra == ["trainer.total_steps=200"]
    with pytest.raises(SystemExit):
        main(["train", "run.name=r", "--resume", "--no-such-flag"])


def _saved_run(tmp_path: Path, *overrides: str) -> Path:
    from relax_core import dump_config

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    cfg = load_run_config(None, [f"run.output_dir={tmp_path}", "run.name=r", *overrides])
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir


def test_resume_continues_the_saved_config_with_safe_overrides_only(tmp_path: Path) -> None:
    run_dir = _saved_run(
        tmp_path, "trainer.total_steps=200", "trainer.groups_per_step=8", "trainer.micro_batch_groups=8"
    )
    named = [f"run.output_dir={tmp_path}", "run.name=r"]
    cfg, changed = resume_config(run_dir, None, named)
    assert cfg.trainer.total_steps == 200 and cfg.trainer.groups_per_step == 8 and changed == {}
    cfg, changed = resume_config(run_dir, None, [*named, "trainer.total_steps=300", "trainer.max_minutes=20"])
    assert cfg.trainer.total_steps == 300 and cfg.trainer.groups_per_step == 8
    # the LR schedule's length follows the run's (it was derived, not set)
    assert changed == {
        "optimizer.total_steps": (200, 300),
        "trainer.max_minutes": (8.0, 20.0),
        "trainer.total_steps": (200, 300),
    }
    assert cfg.optimizer.total_steps == 300
    with pytest.raises(ConfigError, match=r"algorithm.group_size: cannot change on --resume"):
        resume_config(run_dir, None, [*named, "algorithm.group_size=4"])


@pytest.mark.slow  # ~28 s; out of the default suite for its 12-minute budget (SIGTERM mid-run: test_cli_and_cluster)
def test_sigterm_during_start_up_is_handled(tmp_path: Path) -> None:
    """A signal while torch and Ray are imported used to abort with a core dump (rc 134)."""
    import signal

    cmd = [sys.executable, "-m", "relax_services.cli", "train", f"run.output_dir={tmp_path}", "run.name=early"]
    cmd += ["trainer.total_steps=1", "trainer.warmup_format_steps=0", "data.train_per_task=4", "data.eval_per_task=2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once the config is checked, just before the heavy imports
    assert "run folder" in line, line
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode in (0, 1), (proc.returncode, err[-2000:])  # 1: before Ray; 0: a run stopped cleanly
    assert "Traceback" not in err and "SIGTERM" in out + err, (out[-2000:], err[-2000:])


_NO_VLLM = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vllm is installed here: the missing-extra path cannot run"
)


@_NO_VLLM
def test_vllm_engine_without_vllm_fails_before_heavy_imports_naming_the_extra(tmp_path: Path) -> None:
    result, err = _cli("train", "rollout.engine=vllm", "data.tasks=[text]", f"run.output_dir={tmp_path / 'runs'}")
    assert result == {"rc": 2, "heavy": []}, err
    assert "rollout.engine" in err and "needs the package 'vllm'" in err and "relax-services[vllm]" in err, err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


@_NO_VLLM
def test_vllm_engine_without_vllm_is_a_config_issue(tmp_path: Path) -> None:
    from relax_services.control.preflight import check_run

    cfg = load_run_config(None, ["rollout.engine=vllm", "data.tasks=[text]", f"run.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        check_run(cfg)
    [issue] = info.value.issues
    assert (issue.path, issue.value) == ("rollout.engine", "vllm")
    assert "relax-services[vllm]" in issue.message
    check_run(load_run_config(None, [f"run.output_dir={tmp_path}"]))  # the default engine needs nothing more


def test_text_only_rollout_engine_with_media_tasks_is_a_config_issue(tmp_path: Path) -> None:
    from relax_services.control.preflight import check_run

    cfg = load_run_config(None, ["rollout.engine=vllm", "data.tasks=[image, text]", f"run.output_dir={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        check_run(cfg)
    [issue] = [i for i in info.value.issues if i.path == "data.tasks"]
    assert "text prompts only" in issue.message and "['image']" in issue.message
    assert {i.path for i in info.value.issues} <= {"data.tasks", "rollout.engine"}  # the latter without vLLM


def test_own_process_rollout_engine_in_the_colocated_mode_is_a_config_issue(tmp_path: Path) -> None:
    result, err = _cli(
        "train", "rollout.engine=vllm", "data.tasks=[text]", "run.mode=colocated", f"run.output_dir={tmp_path}"
    )
    assert result == {"rc": 2, "heavy": []}, err
    assert "run.mode" in err and "process of its own" in err and "run.mode=distributed" in err, err


@pytest.mark.integration
@pytest.mark.slow  # ~21 s; the dry run's placement rows stay in the default suite (tests/hosting/test_placement.py)
def test_dry_run_places_without_loading_a_model_or_writing_a_run_folder(tmp_path: Path) -> None:
    out = tmp_path / "runs"
    probe, printed, err = _cli_output(
        "train",
        "--dry-run",
        f"run.output_dir={out}",
        "run.device=cpu",
        "trainer.world_size=2",
        "trainer.sequence_parallel=2",
    )
    assert probe["rc"] == 0, err[-2000:]
    assert "torch" not in probe["heavy"] and "transformers" not in probe["heavy"]  # Ray only: it asks the cluster
    assert not out.exists()  # nothing written
    # The Trainer's mesh first: two ranks of one sequence-parallel group (the plan's cp dimension), one dp replica.
    assert "[trainer] engine fsdp, 2 rank(s) over gloo: tp=1 pp=1 cp=2 ep=1 dp=1" in printed
    assert "mesh       (pp, dp, cp, tp) = (1, 1, 2, 1)" in printed
    assert printed.index("[trainer]") < printed.index("[placement]")
    cuda, err = _cli("train", "--dry-run", f"run.output_dir={out}", "run.device=cuda")
    assert cuda["rc"] == 2
    assert "relax train: run.device='cuda', but Ray reports no GPU; use run.device=cpu or auto" in err


@pytest.mark.slow  # a child process reads the checkpoint (~6 s); the rule itself is unit-tested in tests/config
def test_sequence_parallel_that_does_not_divide_the_models_heads_fails_before_ray(tmp_path: Path) -> None:
    """The tiny thinker has 4 attention heads: sp = 8 cannot give each rank a whole one."""
    out = tmp_path / "runs"
    probe, err = _cli(
        "train",
        f"run.output_dir={out}",
        "trainer.world_size=8",
        "trainer.sequence_parallel=8",
        "trainer.groups_per_step=8",
    )
    assert probe == {"rc": 2, "heavy": []}, err[-2000:]
    assert "trainer.sequence_parallel=8 × trainer.tensor_parallel=1 must divide the model's attention heads (4)" in err
    assert not out.exists()


def test_lora_target_the_model_lacks_fails_before_heavy_imports_naming_its_layers(tmp_path: Path) -> None:
    """The names are read from the model built on the meta device in a child process (the driver stays light)."""
    out = tmp_path / "runs"
    probe, err = _cli("train", f"run.output_dir={out}", "model.lora.target_modules=[q_proj,qkv]")
    assert probe == {"rc": 2, "heavy": []}, err[-2000:]
    assert "relax train: model.lora.target_modules: ['qkv'] name no linear layer of the model" in err
    assert "'down_proj'" in err and "'q_proj'" in err and "Traceback" not in err
    assert not out.exists()


def test_missing_reward_requirement_fails_before_ray_naming_module_and_install_command(tmp_path: Path) -> None:
    """``reward.requirements``: a module that is not installed stops ``relax train`` before torch, transformers or
    Ray are imported, naming the module and the command whose install survives ``uv sync``; a found module (json,
    and a dotted one) passes."""
    missing = "relax_no_such_scorer_pkg"
    assert importlib.util.find_spec(missing) is None
    result, err = _cli(
        "train",
        f"reward.requirements=[json, email.mime, {missing}.sub=relax-no-such-scorer>=1.2]",
        f"run.output_dir={tmp_path / 'runs'}",
    )
    assert result == {"rc": 2, "heavy": []}, err
    assert "reward.requirements" in err and f"module '{missing}.sub'" in err, err
    assert "uv add --group reward 'relax-no-such-scorer>=1.2'" in err, err
    assert "uv sync --locked --all-packages --group reward" in err, err
    assert "'json'" not in err and "email.mime" not in err, err  # installed modules are not reported
    assert not (tmp_path / "runs").exists()


def test_reward_requirements_reject_names_that_are_not_modules() -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, ["reward.requirements=[no-dash-in-modules]"])
    assert "reward.requirements" in str(info.value) and "'module' or 'module=package'" in str(info.value)

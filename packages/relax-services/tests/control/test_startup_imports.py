"""What a colocated run's start-up imports and spawns: the single-process engines come without the FSDP2 stack
(``torch.distributed``'s checkpoint and FSDP modules), and ``model.source`` is validated in process where the model
stack is imported anyway (checked in a fresh interpreter each, which starts with neither loaded)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import pytest

FSDP_STACK = ("torch.distributed.checkpoint", "torch.distributed.fsdp", "relax_services.engines.fsdp.train")

RunScript = Callable[..., dict[str, object]]  # the run_script fixture (conftest.py)


_ENGINES = """
import json, sys
import relax_services.engines as engines
from relax_services.engines import TorchTrainEngine, make_train_engine  # the single-process engine's names
before = sorted(m for m in %r if m in sys.modules)
fsdp = engines.FSDPTrainEngine  # resolved on first use
print(json.dumps({"before": before, "after": fsdp.__module__, "listed": "FSDPTrainEngine" in dir(engines)}))
"""


def test_engines_import_the_fsdp_stack_only_when_an_fsdp_name_is_used(run_script: RunScript) -> None:
    # Before, relax_services.engines imported fsdp_train eagerly: seconds of every colocated start-up (4 s of the
    # colocated module's 21 s import under load) for an engine a world_size=1 run never builds.
    result = run_script(_ENGINES % (FSDP_STACK,))
    assert result["before"] == []
    assert result["after"] == "relax_services.engines.fsdp.train"
    assert result["listed"] is True


_CHECK = """
import json, subprocess, sys
from relax_services.models.source_check import check_source
def no_child(*args, **kwargs):
    raise AssertionError(f"a child process was started: {args[0]}")
subprocess.run = no_child  # the in-process check must not need one
path = check_source(sys.argv[1], 0, in_process=True)
print(json.dumps({"path": str(path), "transformers": "transformers" in sys.modules}))
"""


def test_colocated_source_check_runs_in_process(tmp_path: Path, run_script: RunScript) -> None:
    # Before, the colocated driver validated model.source in a child interpreter that imported torch and
    # transformers, then imported both again itself for the services: a second interpreter start-up per run.
    from relax_services.models.tiny_families import write_tiny_checkpoint

    folder = write_tiny_checkpoint(tmp_path / "model", "qwen2", 0)
    result = run_script(_CHECK, str(folder))
    assert Path(str(result["path"])) == folder
    assert result["transformers"] is True  # validated here, with the model stack the services use


def test_colocated_run_asks_for_the_in_process_check(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from relax_services import cli

    seen: list[bool] = []

    class Stop(Exception):
        pass

    def check(source: object, seed: int = 0, *, in_process: bool = False) -> Path:
        seen.append(in_process)
        raise Stop

    monkeypatch.setattr("relax_services.models.source_check.check_source", check)
    for mode in ("colocated", "distributed"):
        with contextlib.suppress(Stop):
            cli.main(["train", f"run.mode={mode}", f"run.output_dir={tmp_path}", f"run.name={mode}"])
    assert seen == [True, False]

"""The driver's modules import no model stack: ``relax_services.control.controller`` (and the CLI that imports it) load
neither torch nor transformers in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_PROBE = """
import json, sys, importlib
importlib.import_module(sys.argv[1])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "numpy"))))
"""


@pytest.mark.parametrize(
    "module",
    [
        "relax_services.control.controller",
        "relax_services.cli",
        "relax_services.control.pipeline",
        "relax_services.data.run_data",
    ],
)
def test_driver_modules_import_neither_torch_nor_transformers(module: str) -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE, module], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_check_engines_finds_modules_without_importing_them() -> None:
    probe = (
        "import sys; from relax_services.engines.registry import check_engines; "
        "from relax_services.config import load_run_config; check_engines(load_run_config(None, [])); "
        "print(sorted(m for m in ('torch', 'relax_services.engines.protocols', 'relax_services.engines.hf', "
        "'relax_services.engines.torch', 'relax_services.engines.fsdp', 'relax_services.models.policy') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


def test_check_engines_names_a_registered_module_that_does_not_exist(monkeypatch: pytest.MonkeyPatch) -> None:
    from relax_services.config import load_run_config
    from relax_services.engines.registry import ROLLOUT_ENGINES, check_engines

    monkeypatch.setitem(ROLLOUT_ENGINES, "hf", "relax_services.engines.no_such_module:build")
    with pytest.raises(ImportError, match=r"'hf': its module 'relax_services\.engines\.no_such_module'"):
        check_engines(load_run_config(None, []))


def test_first_use_writes_the_synthetic_files_without_loading_torch_here(tmp_path: Path) -> None:
    # An empty data folder: the driver resolves the default tasks' files, which must be written (media included)
    # by a child process, so the driver's own modules still hold no torch afterwards.
    probe = (
        "import json, sys; from pathlib import Path; from relax_services.data.synthetic import with_synthetic_files; "
        "from relax_services.config import load_run_config; "
        f"cfg = with_synthetic_files(load_run_config(None, ['data.data_dir={tmp_path}', 'data.train_per_task=4', "
        "'data.eval_per_task=2'])); "
        "files = [f.path for f in cfg.data.train_files + cfg.data.eval_files]; "
        "print(json.dumps([['torch' in sys.modules], [sum(1 for _ in open(p)) for p in files]]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (loaded,), lines = json.loads(out.stdout.strip().splitlines()[-1])
    assert not loaded
    n_tasks = len(lines) // 2
    assert lines == [4] * n_tasks + [2] * n_tasks  # every file written, with its rows

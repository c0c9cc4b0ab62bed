"""Shared fixtures of relax-services' tests. Ray tests use the repository-wide ``ray_session`` fixture (root
conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest

RunScript = Callable[..., dict[str, object]]


def _run_script(script: str, *args: str) -> dict[str, object]:
    """Run ``script`` in a fresh interpreter (so ``sys.modules`` starts empty) and return the JSON object its last
    line of output prints; a failing script fails the test with its stderr."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


@pytest.fixture
def run_script() -> RunScript:
    """:func:`_run_script`: a Python script run in a fresh interpreter, its printed JSON result."""
    return _run_script

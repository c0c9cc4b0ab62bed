"""relax-queue must import and work where torch, numpy and ray are absent.

The check runs in a fresh interpreter with an import hook that refuses those modules, so an
accidental top-level import anywhere in relax_queue fails this test.
"""

import subprocess
import sys
import textwrap
from pathlib import Path

QUEUE_SRC = Path(__file__).resolve().parents[1] / "packages" / "relax-queue" / "src"

_SCRIPT = textwrap.dedent(
    """
    import importlib.abc
    import sys

    BLOCKED = {"torch", "numpy", "ray"}

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ImportError(f"blocked import of {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    sys.path.insert(0, sys.argv[1])
    import relax_queue

    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("OK", relax_queue.__name__)
    """
)


def test_relax_queue_imports_without_ml_dependencies() -> None:
    result = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(QUEUE_SRC)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith("OK relax_queue")

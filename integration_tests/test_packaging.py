"""Each package builds a wheel whose metadata lists only its own dependencies."""

import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    return [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]


@pytest.mark.integration
def test_relax_queue_wheel_has_no_required_dependencies(tmp_path: Path) -> None:
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    subprocess.run(
        [uv, "build", "--package", "relax-queue", "--wheel", "-o", str(tmp_path), "-q"],
        cwd=ROOT,
        check=True,
        timeout=120,
    )
    (wheel,) = tmp_path.glob("relax_queue-*.whl")
    requires = _requires(wheel)
    # Every requirement of relax-queue sits behind an extra: the bare install has none.
    assert requires, "expected the optional extras to be declared"
    assert all("extra ==" in r for r in requires), requires
    names = {r.split(";")[0].split(">")[0].split("=")[0].strip() for r in requires}
    assert names <= {"numpy", "torch", "ray"}, names

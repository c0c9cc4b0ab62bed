"""Loading ``rollout.agent``: every bad input is an error when it is loaded, naming the file (or module) and the
function; the config field is made absolute and excludes ``rollout.env``."""

from __future__ import annotations

from pathlib import Path

import pytest

from relax_services.agents import AgentSpecError, EnvironmentSpecError, load_agent
from relax_services.config import RunConfig


def _write(tmp_path: Path, source: str) -> Path:
    path = tmp_path / "agent.py"
    path.write_text(source)
    return path


def test_a_good_agent_loads(tmp_path: Path) -> None:
    path = _write(tmp_path, "async def run(task, client, retries=2):\n    return None\n")
    spec = load_agent(f"{path}:run")
    assert (spec.name, spec.where, spec.fn.__name__) == ("run", str(path), "run")


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ("import no_such_module_xyz\n", "importing '{path}' failed: ModuleNotFoundError"),
        ("async def run(task, client)\n", "importing '{path}' failed: SyntaxError"),
        ("async def other(task, client):\n    pass\n", "'{path}' has no function 'run'"),
        ("def run(task, client):\n    pass\n", "{path}: run must be 'async def run(task, client)', got a function"),
        ("run = 3\n", "{path}: run must be 'async def run(task, client)', got int"),
        ("async def run(task):\n    pass\n", "{path}: run(task) must take exactly the two arguments (task, client)"),
        ("async def run(task, client, extra):\n    pass\n", "run(task, client, extra) must take exactly"),
        ("async def run(*, task, client):\n    pass\n", "run(task, client) must take exactly"),
    ],
)
def test_bad_agents_are_errors_naming_the_file(tmp_path: Path, source: str, words: str) -> None:
    path = _write(tmp_path, source)
    with pytest.raises(AgentSpecError) as info:
        load_agent(f"{path}:run")
    assert words.format(path=path) in str(info.value)
    assert isinstance(info.value, EnvironmentSpecError)  # one family of spec errors for both settings


def test_a_missing_file_or_module_is_named(tmp_path: Path) -> None:
    with pytest.raises(AgentSpecError, match="does not exist"):
        load_agent(f"{tmp_path / 'absent.py'}:run")
    with pytest.raises(AgentSpecError, match="importing module 'no_such_module_xyz' failed"):
        load_agent("no_such_module_xyz:run")
    with pytest.raises(AgentSpecError, match=r"expected 'path/to/file\.py:function'"):
        load_agent("just_a_name")


def test_rollout_agent_is_a_config_field_made_absolute_and_excludes_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.model_validate({"rollout": {"agent": "agents/mine.py:run"}})
    assert (cfg.rollout.agent, cfg.rollout.env) == (f"{tmp_path / 'agents' / 'mine.py'}:run", None)
    with pytest.raises(ValueError, match=r"rollout\.env .* and rollout\.agent .* are exclusive"):
        RunConfig.model_validate({"rollout": {"agent": "pkg.agents:run", "env": "pkg.envs:Env"}})

"""The environment a user writes: tools read from typed, documented methods, and every bad spec refused when it is
loaded, naming the file and the method."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from relax_services.agents import AgentConfig, EnvironmentSpec, EnvironmentSpecError, load_environment
from relax_services.config import RunConfig

WriteEnv = Callable[..., EnvironmentSpec]

CALCULATOR = """
from typing import Literal

class Env:
    def reset(self, row):
        return [{"role": "user", "content": row["question"]}]

    def add(self, a: int, b: float = 1.0) -> float:
        \"\"\"Adds two numbers.

        Args:
            a: The first number.
            b: The second number, which
                defaults to one.
        \"\"\"
        return a + b

    async def lookup(self, key: str, mode: Literal["exact", "prefix"], tags: list[str] | None = None) -> str:
        \"\"\"Looks a key up.

        Args:
            key: What to look up.
            mode: How to match.
        \"\"\"
        return key

    def reward(self) -> float:
        return 1.0

    def _helper(self):
        return None
"""


def test_tools_are_the_typed_documented_public_methods(write_env: WriteEnv) -> None:
    spec = write_env(CALCULATOR)
    assert list(spec.tools) == ["add", "lookup"]  # reset and reward are the interface; _helper is private
    assert spec.has_reward and not spec.has_step and not spec.has_close
    assert spec.schemas()[0] == {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Adds two numbers.",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "description": "The first number."},
                    "b": {"type": "number", "description": "The second number, which defaults to one."},
                },
                "required": ["a"],
            },
        },
    }
    lookup = spec.tools["lookup"]
    assert lookup.is_async and not spec.tools["add"].is_async
    assert lookup.parameters["properties"] == {
        "key": {"type": "string", "description": "What to look up."},
        "mode": {"enum": ["exact", "prefix"], "type": "string", "description": "How to match."},
        "tags": {"type": "array", "items": {"type": "string"}},
    }
    assert lookup.required == ("key", "mode")


def test_a_module_class_loads_like_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_env_module.py").write_text(CALCULATOR)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert list(load_environment("my_env_module:Env").tools) == ["add", "lookup"]


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("raise RuntimeError('boom')\n", ["importing", "RuntimeError: boom"]),
        ("class Env:\n    def step(self, m):\n        return [], None, True\n", ["Env has no method reset"]),
        (
            "class Env:\n    def reset(self, row):\n        return []\n    def add(self, a, b: int) -> int:\n"
            "        '''Adds.'''\n        return a\n",
            ["method Env.add", "parameter 'a' has no type hint"],
        ),
        (
            "class Env:\n    def reset(self, row):\n        return []\n    def add(self, a: int) -> int:\n"
            "        return a\n",
            ["method Env.add", "no docstring"],
        ),
        (
            "class Env:\n    def reset(self, row):\n        return []\n    def add(self, a: int):\n"
            "        '''Adds.'''\n        return a\n",
            ["method Env.add", "no return type hint"],
        ),
        (
            "class Env:\n    def reset(self, row):\n        return []\n    def add(self, a: bytes) -> int:\n"
            "        '''Adds.'''\n        return 0\n",
            ["method Env.add", "parameter 'a'", "no JSON schema"],
        ),
        ("class Env:\n    def reset(self, row):\n        return []\n", ["neither tools", "nor step"]),
        ("class Other:\n    pass\n", ["has no class 'Env'"]),
    ],
)
def test_a_bad_environment_is_refused_naming_file_and_method(tmp_path: Path, source: str, named: list[str]) -> None:
    path = tmp_path / "bad_env.py"
    path.write_text(source)
    with pytest.raises(EnvironmentSpecError) as info:
        load_environment(f"{path}:Env")
    message = str(info.value)
    assert str(path) in message
    for part in named:
        assert part in message


def test_a_missing_file_or_module_is_named(tmp_path: Path) -> None:
    with pytest.raises(EnvironmentSpecError, match="does not exist"):
        load_environment(f"{tmp_path / 'absent.py'}:Env")
    with pytest.raises(EnvironmentSpecError, match="importing module 'no_such_module_xyz' failed"):
        load_environment("no_such_module_xyz:Env")
    with pytest.raises(EnvironmentSpecError, match=r"expected 'path/to/file\.py:Class'"):
        load_environment("just_a_name")


def test_rollout_env_is_a_config_field_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = RunConfig.model_validate({"rollout": {"env": "envs/tools.py:Env", "max_turns": 3, "env_failure": "requeue"}})
    assert cfg.rollout.env == f"{tmp_path / 'envs' / 'tools.py'}:Env"
    assert (cfg.rollout.max_turns, cfg.rollout.env_failure) == (3, "requeue")
    agent = AgentConfig.from_rollout(cfg.rollout)
    assert (agent.max_turns, agent.env_failure, agent.max_new_tokens) == (3, "requeue", cfg.rollout.max_new_tokens)
    assert RunConfig.model_validate({"rollout": {"env": "pkg.envs:Env"}}).rollout.env == "pkg.envs:Env"
    with pytest.raises(ValueError, match="env_failure"):
        RunConfig.model_validate({"rollout": {"env_failure": "drop"}})


def test_the_documented_example_loads(tmp_path: Path) -> None:
    page = (Path(__file__).resolve().parents[4] / "docs" / "multi-turn.md").read_text(encoding="utf-8")
    section = page.split("## Multi-turn environments and tools", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "calculator.py").write_text(code)
    spec = load_environment(f"{tmp_path / 'calculator.py'}:Calculator")
    assert list(spec.tools) == ["add"] and spec.has_reward and spec.has_close and not spec.has_step
    env = spec.new()
    env.reset({"question": "1+2?", "reward_model": {"ground_truth": "3"}})  # type: ignore[attr-defined]
    env.add(1, 2)  # type: ignore[attr-defined]
    assert env.reward() == 1.0  # type: ignore[attr-defined]

"""The SmolLM2 calculator example (``examples/smollm2/calculator.py``): its tool, the schema the model is shown,
the reward on decoded episodes, and the task files ``prepare.py`` writes. Values are worked by hand."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

from relax_core import import_file
from relax_services.agents import load_environment, parse_qwen_tool_calls

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2"


def _load(name: str) -> ModuleType:
    return import_file(EXAMPLE / f"{name}.py", f"smollm2_{name}", f"examples/smollm2/{name}.py")


CALL = '<tool_call>[{"name": "multiply", "arguments": {"a": 47, "b": 86}}]</tool_call>'


def test_the_tool_multiplies_and_its_schema_is_two_required_integers() -> None:
    env = load_environment(f"{EXAMPLE / 'calculator.py'}:Calculator")
    assert list(env.tools) == ["multiply"]  # reset is the lifecycle, not a tool
    params = env.tools["multiply"].parameters
    assert params["required"] == ["a", "b"]
    assert params["properties"] == {
        "a": {"type": "integer", "description": "The first factor."},
        "b": {"type": "integer", "description": "The second factor."},
    }
    calc = env.new()
    # 47 * 86 = 47 * 80 + 47 * 6 = 3760 + 282 = 4042; 99 * 99 = 9801; 11 * 11 = 121
    products = [calc.multiply(47, 86), calc.multiply(99, 99), calc.multiply(11, 11)]  # type: ignore[attr-defined]
    assert products == [4042, 9801, 121]
    # the call format the system prompt shows (a JSON list in the tag) is what the family's parser reads
    (call,) = parse_qwen_tool_calls(CALL)
    assert (call.name, call.arguments, call.error) == ("multiply", {"a": 47, "b": 86}, None)


def test_score_reads_the_final_assistant_turn() -> None:
    calc = _load("calculator")
    episode = f"{CALL}\ntool\n4042\nassistant\n"  # a decoded episode: call, tool result, then the final turn
    assert calc.score(episode + "4042", "4042", {}) == 1.0
    assert calc.score(episode + "47 * 86 = 4042", "4042", {}) == 1.0  # restated product, then the answer
    assert calc.score(episode + "The answer is 4042.", "4042", {}) == 1.0
    assert calc.score(episode + "4043", "4042", {}) == 0.0
    assert calc.score(CALL, "4042", {}) == 0.0  # ran out of turns on a call: its arguments are no answer
    assert calc.score("4042", "4042", {}) == 1.0  # right without the tool counts too
    assert calc.score("47*86 = 3024", "4042", {}) == 0.0  # the base model's head arithmetic


def test_prepare_writes_every_product_once_with_the_tool_in_the_prompt(tmp_path: Path) -> None:
    prepare = _load("prepare")
    train, held_out = prepare.write_calculator_task(tmp_path, eval_size=10)
    pairs = []
    for path in (train, held_out):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            messages = row["prompt"]
            assert messages[0]["role"] == "system" and '"name": "multiply"' in messages[0]["content"]
            assert [m["role"] for m in messages[1:]] == ["user", "assistant", "tool", "assistant", "user"]
            match = re.fullmatch(r"What is (\d+)\*(\d+)\? Use the multiply tool\.", messages[-1]["content"])
            assert match is not None
            a, b = int(match.group(1)), int(match.group(2))
            assert row["reward_model"]["ground_truth"] == str(a * b)
            pairs.append((a, b))
    # factors 11..99 with a <= b: 89 * 90 / 2 = 4005 pairs, each once, 10 held out
    assert len(pairs) == len(set(pairs)) == 4005 and all(11 <= a <= b <= 99 for a, b in pairs)
    assert len(held_out.read_text().splitlines()) == 10

"""The episode runner with scripted assistant turns (a test double of the engine writes them, so tool calls happen
deterministically; ``test_runner_hf.py`` checks log-probs on the real engine): tool calls and their failures
answered to the model and counted, environment failures handled per ``env_failure``, the bounds, and the tokens,
mask, log-probs and versions of every turn."""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from typing import Any

import pytest

from relax_services.agents import AgentConfig, EnvironmentSpec, Episode, EpisodeRunner
from relax_services.engines import SamplingParams
from relax_services.models import FAMILIES

FAMILY = FAMILIES["Qwen2ForCausalLM"]

TOOL_ENV = """
import asyncio
import time

class Env:
    def reset(self, row):
        return [{"role": "user", "content": row["q"]}]

    def echo(self, text: str) -> str:
        '''Echoes a text.

        Args:
            text: What to echo.
        '''
        return "got " + text

    def boom(self) -> str:
        '''Raises.'''
        raise ValueError("bad input")

    async def hang(self) -> str:
        '''Never returns.'''
        await asyncio.sleep(3600)
        return ""

    def slow(self) -> dict[str, int]:
        '''Returns after the tool timeout.'''
        time.sleep(1.0)
        return {"late": 1}

    def big(self) -> str:
        '''A long result.'''
        return "a" * 100 + "z" * 100

    def reward(self) -> float:
        return 0.5
"""


def call(name: str, **arguments: object) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


SCRIPTS: dict[str, list[str]] = {
    "a": ["let me see " + call("echo", text="hi"), "<tool_call>{bad json</tool_call>", call("nope"), "done"],
    "b": [call("boom") + call("hang"), call("slow"), "the end"],
}


def script_of(scripts: dict[str, list[str]]) -> Callable[[str], str]:
    """Each row's turns in order: the row is the first user message, the turn the assistant turns so far."""

    def script(prompt: str) -> str:
        row = prompt.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0]
        return scripts[row][prompt.count("<|im_start|>assistant\n") - 1]

    return script


def params(tokenizer: Any) -> SamplingParams:
    return SamplingParams(eos_id=tokenizer.eos_token_id, max_new_tokens=64)


def run(
    tokenizer: Any,
    engine: Any,
    env: EnvironmentSpec,
    rows: list[dict[str, object]],
    group_size: int = 1,
    **config: Any,
) -> list[list[Episode]]:
    config = {"max_new_tokens": 200, **config}  # the tokenizer is one character a token
    with EpisodeRunner(engine, env, tokenizer, FAMILY, params(tokenizer), AgentConfig(**config)) as runner:
        return runner.run_sync(rows, group_size)


def check_tokens(tokenizer: Any, env: EnvironmentSpec, ep: Episode, version: int) -> None:
    """Assistant tokens: the script's text + eos, mask 1, the scripted log-probs; environment tokens: mask 0,
    log-prob 0, the version before them; all of it the tokenisation of the whole conversation re-rendered."""
    n = len(ep.token_ids)
    assert len(ep.logprobs) == len(ep.sampling_logprobs) == len(ep.versions) == len(ep.mask) == n
    assert ep.versions == [version] * n
    runs: list[tuple[int, int]] = []  # (mask, length) of each segment
    for m in ep.mask:
        runs = [*runs[:-1], (m, runs[-1][1] + 1)] if runs and runs[-1][0] == m else [*runs, (m, 1)]
    assert [m for m, _ in runs] == [1, 0] * (len(runs) // 2) + [1] * (len(runs) % 2)
    start = 0
    for m, length in runs:
        lps = ep.logprobs[start : start + length]
        assert lps == ([-(i + 1) / 64 for i in range(length)] if m else [0.0] * length)
        start += length
    assert ep.counters.env_tokens == ep.mask.count(0)
    assert ep.counters.turns == sum(m for m, _ in runs)  # one run of policy tokens per assistant turn
    text = tokenizer.apply_chat_template(ep.messages, tools=env.schemas(), tokenize=False)
    whole = tokenizer.encode(text, add_special_tokens=False)
    ours = ep.prompt_ids + ep.token_ids
    if ep.finish_reason in ("stop", "max_turns"):
        assert whole == [*ours, *tokenizer.encode("\n", add_special_tokens=False)]  # the template's newline after eos


def test_tool_calls_and_their_failures_are_answered_and_counted(qwen_tokenizer: Any, scripted_engine: Any, write_env):
    env = write_env(TOOL_ENV)
    engine = scripted_engine(qwen_tokenizer, script_of(SCRIPTS))
    (a,), (b,) = run(qwen_tokenizer, engine, env, [{"q": "a"}, {"q": "b"}], max_turns=6, tool_timeout_s=0.3)

    assert (a.finish_reason, b.finish_reason) == ("stop", "stop")
    assert dataclasses.astuple(a.counters)[:4] == (4, 3, 2, 0)  # turns, tool_calls, tool_errors, tool_timeouts
    assert dataclasses.astuple(b.counters)[:4] == (3, 3, 1, 2)
    assert (a.reward, b.reward) == (0.5, 0.5)
    tool_a = [m["content"] for m in a.messages if m["role"] == "tool"]
    assert tool_a[0] == "got hi"
    assert json.loads(tool_a[1])["error"].startswith("the tool call is not valid JSON")
    assert json.loads(tool_a[2])["error"] == "unknown tool 'nope'; tools: ['big', 'boom', 'echo', 'hang', 'slow']"
    tool_b = [json.loads(str(m["content"]))["error"] for m in b.messages if m["role"] == "tool"]
    assert tool_b == [
        "tool 'boom' raised ValueError: bad input",
        "tool 'hang' timed out after 0.3s",
        "tool 'slow' timed out after 0.3s",
    ]
    for ep in (a, b):
        check_tokens(qwen_tokenizer, env, ep, version=3)

    # one batched call per turn over the episodes still running, n = 1 each; each prompt extends the last
    assert [(k, p.n) for k, p in engine.calls] == [(2, 1), (2, 1), (2, 1), (1, 1)]
    for before, after in zip(engine.prompts, engine.prompts[1:], strict=False):
        assert after[0][: len(before[0])] == before[0]
    assert engine.prompts[-1][0] == a.prompt_ids + a.token_ids[: len(engine.prompts[-1][0]) - len(a.prompt_ids)]


def test_a_group_has_one_environment_per_episode(qwen_tokenizer: Any, scripted_engine: Any, write_env) -> None:
    source = TOOL_ENV.replace("return 0.5", "return float(len(self.seen))").replace(
        'return "got " + text', "self.seen = [*getattr(self, 'seen', []), text]\n        return \"got \" + text"
    )
    env = write_env(source)
    engine = scripted_engine(qwen_tokenizer, script_of({"c": [call("echo", text="x"), "ok"]}))
    (group,) = run(qwen_tokenizer, engine, env, [{"q": "c"}], group_size=3)
    assert [ep.reward for ep in group] == [1.0, 1.0, 1.0]  # each instance saw its own episode's one call
    assert [k for k, _ in engine.calls] == [3, 3]


STEP_ENV = """
import asyncio

class Env:
    def reset(self, row):
        self.turn = 0
        if row["q"] == "reset fails":
            raise RuntimeError("no such task")
        return [{"role": "user", "content": row["q"]}]

    async def step(self, assistant_message):
        self.turn += 1
        if self.turn == 2 and "hang" in assistant_message["content"]:
            await asyncio.sleep(3600)
        if self.turn == 2 and "raise" in assistant_message["content"]:
            raise KeyError("state")
        return [{"role": "user", "content": "again"}], float(self.turn), self.turn == 3
"""


@pytest.mark.parametrize("policy", ["zero", "requeue"])
def test_a_hanging_or_raising_environment_is_counted_and_handled(
    qwen_tokenizer: Any, scripted_engine: Any, write_env, policy: str
) -> None:
    env = write_env(STEP_ENV)
    scripts = {"fine": ["x", "y", "z"], "hang": ["x", "hang"], "raise": ["x", "raise"], "reset fails": []}
    engine = scripted_engine(qwen_tokenizer, script_of(scripts))
    rows = [{"q": q} for q in scripts]
    (fine,), (hang,), (boom,), (reset,) = run(qwen_tokenizer, engine, env, rows, env_timeout_s=0.3, env_failure=policy)

    assert (fine.finish_reason, fine.reward, fine.counters.turns, fine.requeue) == ("stop", 3.0, 3, False)
    for ep, why in ((hang, "Env.step timed out after 0.3s"), (boom, "Env.step raised KeyError: 'state'")):
        assert (ep.finish_reason, ep.error, ep.counters.env_failures) == ("env_error", why, 1)
        assert ep.counters.turns == 2 and ep.mask.count(0) > 0  # the tokens so far are kept
        assert (ep.reward, ep.requeue) == ((0.0, False) if policy == "zero" else (None, True))
        check_tokens(qwen_tokenizer, env, ep, version=3)
    # a failed reset has nothing to score: it is generated again under either policy
    assert (reset.finish_reason, reset.requeue, reset.prompt_ids, reset.counters.env_failures) == (
        "env_error",
        True,
        [],
        1,
    )
    assert "RuntimeError: no such task" in str(reset.error)


def test_the_bounds(qwen_tokenizer: Any, scripted_engine: Any, write_env) -> None:
    env = write_env(TOOL_ENV)
    scripts = {"turns": [call("echo", text="a")] * 5, "big": [call("big"), "ok"], "long": ["abcdefghij" * 30]}
    engine = scripted_engine(qwen_tokenizer, script_of(scripts))
    rows = [{"q": q} for q in scripts]
    (turns,), (big,), (long,) = run(qwen_tokenizer, engine, env, rows, max_turns=2, max_tool_output_tokens=20)
    assert (turns.finish_reason, turns.counters.turns, turns.counters.tool_calls) == ("max_turns", 2, 2)
    assert turns.mask[-1] == 1  # nothing follows the last turn
    cut = next(m["content"] for m in big.messages if m["role"] == "tool")
    assert cut == "a" * 10 + "\n... 180 tokens cut ...\n" + "z" * 10
    # a turn without its eos ends the episode
    assert (long.finish_reason, len(long.token_ids), long.mask) == ("length", 200, [1] * 200)

    # the episode budget: the second turn gets what is left of it, and ends without its eos
    budget = len(engine.prompts[1][0]) - len(engine.prompts[0][0]) + 5
    engine = scripted_engine(qwen_tokenizer, script_of({"turns": [call("echo", text="a")] * 5}))
    ((ep,),) = run(qwen_tokenizer, engine, env, [{"q": "turns"}], max_turns=4, max_episode_tokens=budget)
    assert (ep.finish_reason, len(ep.token_ids), ep.counters.turns) == ("length", budget, 2)
    assert engine.calls[1][1].max_new_tokens == 5


def test_a_template_break_at_a_turn_ends_the_episode(qwen_tokenizer: Any, scripted_engine: Any, write_env) -> None:
    tokenizer = copy.deepcopy(qwen_tokenizer)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "'<|im_start|>' + message.role + '\\n' + message.content",
        "'<|im_start|>' + message.role + '\\n' + message.content.split('</think>')[-1]",
    )
    env = write_env(TOOL_ENV)
    engine = scripted_engine(tokenizer, script_of({"t": [call("echo", text="a"), "<think>r</think>" + call("boom")]}))
    ((ep,),) = run(tokenizer, engine, env, [{"q": "t"}])
    assert (ep.finish_reason, ep.counters.turns) == ("template", 2)
    assert "family qwen2" in str(ep.error)
    assert ep.mask[-1] == 1  # the tool's answer to the second turn is not appended


def test_to_completion_carries_the_mask(qwen_tokenizer: Any, scripted_engine: Any, write_env) -> None:
    env = write_env(TOOL_ENV)
    engine = scripted_engine(qwen_tokenizer, script_of({"m": [call("echo", text="a"), "ok"]}))
    ((ep,),) = run(qwen_tokenizer, engine, env, [{"q": "m"}])
    completion = ep.to_completion()
    assert 0 in ep.mask and completion.mask == ep.mask
    assert completion.loss_mask == ep.mask
    assert (completion.token_ids, completion.logprobs) == (ep.token_ids, ep.logprobs)
    assert completion.versions == ep.versions
    single = Episode(token_ids=[5, 2], logprobs=[-1.0, -2.0], sampling_logprobs=[-1.0, -2.0], versions=[0, 0])
    single.mask, single.finish_reason = [1, 1], "stop"
    assert single.to_completion().token_ids == [5, 2]


def test_text_the_tokenizer_cannot_hold_is_an_environment_failure(scripted_engine: Any, write_env) -> None:
    """The default tokenizer has no ``{``: a message with one fails the episode (counted), not the run."""
    from relax_services.models.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    env = write_env(STEP_ENV.replace('"again"', '"{x}"'))
    engine = scripted_engine(tokenizer, script_of({"fine": ["x", "y"]}))
    ((ep,),) = run(tokenizer, engine, env, [{"q": "fine"}])
    assert (ep.finish_reason, ep.counters.env_failures, ep.reward, ep.counters.turns) == ("env_error", 1, 0.0, 1)
    assert "cannot be tokenised" in str(ep.error)


def test_an_episode_past_its_timeout_fails(qwen_tokenizer: Any, scripted_engine: Any, write_env) -> None:
    """Each step takes 0.3 s, within ``env_timeout_s``; the episode's 0.5 s are spent by the second step at the
    latest (elapsed time only grows), so the episode fails there or before, counted, and keeps its tokens."""
    source = """
import time

class Env:
    def reset(self, row):
        return [{"role": "user", "content": row["q"]}]

    def step(self, assistant_message):
        time.sleep(0.3)
        return [{"role": "user", "content": "again"}], None, False
"""
    env = write_env(source)
    engine = scripted_engine(qwen_tokenizer, script_of({"slow": ["x"] * 5}))
    ((ep,),) = run(qwen_tokenizer, engine, env, [{"q": "slow"}], max_turns=5, episode_timeout_s=0.5, env_timeout_s=10)
    assert (ep.finish_reason, ep.counters.env_failures, ep.reward) == ("env_error", 1, 0.0)
    assert "episode_timeout_s=0.5" in str(ep.error) and 1 <= ep.counters.turns <= 2


def test_media_parts_of_an_environment_that_declares_none_are_an_environment_failure(
    qwen_tokenizer: Any, scripted_engine: Any, write_env
) -> None:
    source = STEP_ENV.replace(
        '[{"role": "user", "content": "again"}]',
        '[{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "see"}]}]',
    )
    env = write_env(source)
    engine = scripted_engine(qwen_tokenizer, script_of({"fine": ["x", "y"]}))
    ((ep,),) = run(qwen_tokenizer, engine, env, [{"q": "fine"}], env_failure="requeue")
    assert (ep.finish_reason, ep.requeue, ep.counters.env_failures) == ("env_error", True, 1)
    assert "step returned image parts, which the environment does not declare (its modalities: ())" in str(ep.error)

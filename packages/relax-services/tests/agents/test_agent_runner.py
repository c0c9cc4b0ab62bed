"""The black-box agent (``rollout.agent``) with scripted assistant turns: the ``openai`` package's client drives the
endpoint over real HTTP; the episode's tokens are the chat template's rendering of the final conversation, its mask 0
exactly on the tool's and the template's tokens, its log-probs the engine's; a raising and a hanging agent are
counted; a conversation that does not extend the recorded tokens starts a new sample; calls of concurrent sessions
share a generate call."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from relax_services.agents import AgentConfig, AgentRunner, Episode, load_agent
from relax_services.engines import SamplingParams
from relax_services.models import FAMILIES
from relax_services.services.rollout import episode_metrics

FAMILY = FAMILIES["Qwen2ForCausalLM"]
VERSION = 3
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

AGENT = '''
import asyncio
import json

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Adds.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


async def run(task, client):
    """Asks, runs the tool the model calls, sends its result back, and scores the final answer."""
    messages = [{"role": "user", "content": task["q"]}]
    first = await client.chat.completions.create(
        model="policy", messages=messages, tools=TOOLS, temperature=1.0, max_tokens=100
    )
    message = first.choices[0].message
    task["seen"].append((first.choices[0].finish_reason, message.content, message.model_dump()["tool_calls"]))
    if task.get("mode") == "raise":
        raise RuntimeError("the agent broke")
    if task.get("mode") == "hang":
        await asyncio.Event().wait()
    messages.append(message)  # the SDK's message object, re-sent as the SDK serialises it
    call = message.tool_calls[0]
    args = json.loads(call.function.arguments)
    content = str(args["a"] + args["b"])
    messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    if task.get("mode") == "edit":
        messages[0] = {"role": "user", "content": task["q"] + "!"}  # rewrites history: the tokens do not extend
    second = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    task["seen"].append((second.choices[0].finish_reason, second.choices[0].message.content, None))
    return 1.0 if second.choices[0].message.content == "5" else 0.0
'''

TOOLS = json.loads(AGENT.split("TOOLS = ", 1)[1].split("\n\n\n", 1)[0].replace("\n", ""))
"""The agent's tools (the schema it sends)."""


def script(prompt: str) -> str:
    """Turn 1 calls the tool; turn 2 answers with what the tool returned."""
    if "<tool_response>" not in prompt:
        return CALL
    return prompt.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]


@pytest.fixture
def agent_file(tmp_path: Path) -> Callable[[str], str]:
    count = iter(range(1000))

    def write(source: str) -> str:
        path = tmp_path / f"agent_{next(count)}.py"
        path.write_text(source)
        return str(path)

    return write


def run(
    tokenizer: Any, engine: Any, spec: str, rows: list[dict[str, Any]], group_size: int = 1, **config: Any
) -> list[list[Episode]]:
    params = SamplingParams(eos_id=tokenizer.eos_token_id, max_new_tokens=64)
    cfg = AgentConfig(**{"max_new_tokens": 200, **config})  # the tokenizer is one character a token
    with AgentRunner(engine, load_agent(spec), tokenizer, FAMILY, params, cfg) as runner:
        return runner.run_sync(rows, group_size)


def rendered(tokenizer: Any, messages: list[dict[str, object]], tools: list[Any], **kw: Any) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, **kw))


def test_the_openai_client_drives_two_calls_with_a_tool_round_trip(qwen_tokenizer, scripted_engine, agent_file):
    engine = scripted_engine(qwen_tokenizer, script, version=VERSION)
    spec = f"{agent_file(AGENT)}:run"
    row: dict[str, Any] = {"q": "2+3?", "seen": []}
    ((ep,),) = run(qwen_tokenizer, engine, spec, [row])

    # The agent got OpenAI's schema: the call parsed with the Qwen parser, then the final answer.
    (finish1, content1, calls), (finish2, content2, _) = row["seen"]
    assert (finish1, content1, finish2, content2) == ("tool_calls", None, "stop", "5")
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "add", {"a": 2, "b": 3})
    ]
    assert (ep.reward, ep.finish_reason, ep.error, ep.requeue) == (1.0, "stop", None, False)

    # Tokens: the template's rendering of the final conversation (the tool call as the model wrote it).
    final = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "5"},
        {"role": "assistant", "content": "5"},
    ]
    newline = qwen_tokenizer.encode("\n")
    assert rendered(qwen_tokenizer, final, TOOLS) == ep.prompt_ids + ep.token_ids + newline
    assert ep.prompt_ids == rendered(qwen_tokenizer, final[:1], TOOLS, add_generation_prompt=True)
    eos = qwen_tokenizer.eos_token_id
    turn1, turn2 = [*qwen_tokenizer.encode(CALL), eos], [*qwen_tokenizer.encode("5"), eos]
    between = qwen_tokenizer.encode("\n<|im_start|>user\n<tool_response>\n5\n</tool_response><|im_end|>\n")
    between += qwen_tokenizer.encode("<|im_start|>assistant\n")  # the template's delta, by hand
    assert ep.token_ids == turn1 + between + turn2
    assert ep.mask == [1] * len(turn1) + [0] * len(between) + [1] * len(turn2)
    # Log-probs: the engine's, -(i+1)/64 for the i-th token of a turn, 0 on the delta; versions the engine's.
    engine_lps = [[-(i + 1) / 64 for i in range(len(t))] for t in (turn1, turn2)]
    assert ep.logprobs == engine_lps[0] + [0.0] * len(between) + engine_lps[1]
    assert ep.sampling_logprobs == ep.logprobs
    assert ep.versions == [VERSION] * len(ep.token_ids)
    counters = ep.counters
    assert (counters.turns, counters.tool_calls, counters.tool_errors, counters.env_tokens) == (2, 1, 0, len(between))
    assert (counters.env_failures, counters.prefix_breaks) == (0, 0)
    # The engine saw exactly these prompts: the first, then the recorded tokens and the delta.
    assert engine.prompts == [[ep.prompt_ids], [ep.prompt_ids + turn1 + between]]


def test_a_raising_and_a_hanging_agent_are_counted_and_the_others_finish(qwen_tokenizer, scripted_engine, agent_file):
    engine = scripted_engine(qwen_tokenizer, script, version=VERSION)
    spec = f"{agent_file(AGENT)}:run"
    rows: list[dict[str, Any]] = [{"q": "x", "seen": [], "mode": m} for m in ("raise", "hang", "ok")]
    groups = run(qwen_tokenizer, engine, spec, rows, episode_timeout_s=1.0)
    raised, hung, ok = (g[0] for g in groups)

    assert (ok.finish_reason, ok.reward, ok.counters.env_failures) == ("stop", 1.0, 0)
    assert (raised.finish_reason, raised.reward, raised.requeue) == ("env_error", 0.0, False)
    assert raised.error == "agent run raised RuntimeError: the agent broke"
    assert (hung.finish_reason, hung.reward, hung.requeue) == ("env_error", 0.0, False)
    assert hung.error is not None and "ran past episode_timeout_s=1" in hung.error
    # Their first call's tokens stand (scored 0 under env_failure=zero).
    assert raised.counters.turns == hung.counters.turns == 1 and raised.token_ids and hung.token_ids
    assert episode_metrics([raised, hung, ok])["env_failures"] == 2.0

    (requeued,), (hung_again,), _ = run(
        qwen_tokenizer, engine, spec, rows, episode_timeout_s=1.0, env_failure="requeue"
    )
    assert (requeued.requeue, requeued.reward, hung_again.requeue, hung_again.reward) == (True, None, True, None)


def test_an_agent_without_calls_or_with_a_bad_return_fails(qwen_tokenizer, scripted_engine, agent_file):
    source = "async def run(task, client):\n    if task['call']:\n        await client.chat.completions.create("
    source += "model='m', messages=[{'role': 'user', 'content': 'q'}])\n    return 'high'\n"
    engine = scripted_engine(qwen_tokenizer, script, version=VERSION)
    (silent,), (bad,) = run(qwen_tokenizer, engine, f"{agent_file(source)}:run", [{"call": False}, {"call": True}])
    # No tokens: nothing to score, so it is generated again whatever env_failure says.
    assert (silent.finish_reason, silent.requeue, silent.counters.env_failures) == ("env_error", True, 1)
    assert bad.error is not None and "returned 'high'" in bad.error and bad.reward == 0.0


def test_edited_history_starts_a_new_sample_and_is_counted(qwen_tokenizer, scripted_engine, agent_file, caplog):
    engine = scripted_engine(qwen_tokenizer, script, version=VERSION)
    row: dict[str, Any] = {"q": "2+3?", "seen": [], "mode": "edit"}
    ((ep,),) = run(qwen_tokenizer, engine, f"{agent_file(AGENT)}:run", [row])

    assert ep.counters.prefix_breaks == 1 and "does not extend the tokens recorded" in caplog.text
    assert (ep.counters.turns, ep.counters.env_tokens, ep.reward) == (2, 0, 1.0)
    # The new sample's prompt is the second call's whole conversation; its response the second turn only.
    second = [
        {"role": "user", "content": "2+3?!"},
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "5"},
    ]
    assert ep.prompt_ids == rendered(qwen_tokenizer, second, TOOLS, add_generation_prompt=True)
    assert ep.token_ids == [*qwen_tokenizer.encode("5"), qwen_tokenizer.eos_token_id]
    assert ep.mask == [1, 1] and ep.logprobs == [-1 / 64, -2 / 64]


def test_calls_past_max_turns_get_an_empty_length_reply(qwen_tokenizer, scripted_engine, agent_file):
    engine = scripted_engine(qwen_tokenizer, script, version=VERSION)
    row: dict[str, Any] = {"q": "2+3?", "seen": []}
    ((ep,),) = run(qwen_tokenizer, engine, f"{agent_file(AGENT)}:run", [row], max_turns=1)
    assert row["seen"][1] == ("length", "", None)
    assert (ep.finish_reason, ep.counters.turns, ep.reward) == ("max_turns", 1, 0.0)
    assert ep.mask == [1] * len(ep.token_ids)


def test_calls_of_concurrent_sessions_share_generate_calls(qwen_tokenizer, scripted_engine, agent_file):
    """The engine's first call holds until every session's first call is in it or queued (an event, not a
    duration): the eight sessions' first turns take two generate calls at most."""
    engine = scripted_engine(qwen_tokenizer, script, version=VERSION)
    generate = engine.generate
    runner_box: list[AgentRunner] = []
    queued_behind_first: list[int] = []

    def gated(prompts, params, poll_weights=None):  # type: ignore[no-untyped-def]
        if not queued_behind_first:
            for _ in range(10_000):  # at most 10 s, then the assertion below reports it
                if len(prompts) + runner_box[0].queued >= 8:
                    break
                threading.Event().wait(0.001)
            queued_behind_first.append(runner_box[0].queued)
        return generate(prompts, params, poll_weights)

    engine.generate = gated
    params = SamplingParams(eos_id=qwen_tokenizer.eos_token_id, max_new_tokens=64)
    rows = [{"q": f"{i}", "seen": []} for i in range(4)]
    cfg = AgentConfig(max_new_tokens=200)
    with AgentRunner(engine, load_agent(f"{agent_file(AGENT)}:run"), qwen_tokenizer, FAMILY, params, cfg) as runner:
        runner_box.append(runner)
        groups = runner.run_sync(rows, group_size=2)
    assert all(ep.reward == 1.0 for group in groups for ep in group)
    first, *rest = runner.batch_sizes
    assert first + queued_behind_first[0] == 8  # the first turns of all eight sessions, in the first two calls
    assert first == 8 or rest[0] >= queued_behind_first[0]
    assert sum(runner.batch_sizes) == 16 and len(runner.batch_sizes) < 16


PROBE = '''
import httpx2 as httpx  # the HTTP client the openai package itself uses
import openai


async def run(task, client):
    """Probes the endpoint's protocol; every answer lands in task["seen"]."""
    seen = task["seen"]
    seen.append([m.id for m in (await client.models.list()).data])
    bare = str(client.base_url).rsplit("/", 3)[0] + "/v1"  # http://127.0.0.1:PORT/v1: the key names the session
    for key in ("not-a-session", client.api_key):
        other = openai.AsyncOpenAI(base_url=bare, api_key=key, max_retries=0)
        try:
            reply = await other.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            seen.append(reply.choices[0].message.content)
        except openai.APIStatusError as exc:
            seen.append((exc.status_code, exc.body["code"]))
        await other.close()
    for bad in ({"n": 2}, {"messages": []}, {"stream": True}, {"max_tokens": 0}):
        try:
            kwargs = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **bad}
            await client.chat.completions.create(**kwargs)
        except openai.BadRequestError as exc:
            seen.append(exc.body["message"])
    async with httpx.AsyncClient() as raw:
        reply = await raw.post(str(client.base_url) + "/chat/completions", content=b"{not json")
        seen.append((reply.status_code, reply.json()["error"]["message"][:20]))
        reply = await raw.get(str(client.base_url) + "/embeddings")
        seen.append(reply.status_code)
    return None
'''


def test_the_endpoint_answers_protocol_errors_in_openais_schema(qwen_tokenizer, scripted_engine, agent_file):
    engine = scripted_engine(qwen_tokenizer, lambda prompt: "hello", version=VERSION)
    row: dict[str, Any] = {"seen": []}
    ((ep,),) = run(qwen_tokenizer, engine, f"{agent_file(PROBE)}:run", [row])
    models, unknown, by_key, *bad, raw_json, not_found = row["seen"]
    assert models == ["relax-policy"]
    assert unknown == (401, "invalid_api_key")
    assert by_key == "hello"  # the bare /v1 URL with the session's key reaches the session
    assert bad == [
        "'n' must be 1 (one session is one episode), got 2",
        "'messages' must be a non-empty list of chat messages",
        "'stream' is not supported by the agent endpoint",
        "'max_tokens' must be a positive integer, got 0",
    ]
    assert raw_json == (400, "the body is not JSON")
    assert not_found == 404
    assert (ep.reward, ep.counters.turns, ep.finish_reason) == (None, 1, "stop")  # None: reward.fn scores it


CUT = """
async def run(task, client):
    messages = [{"role": "user", "content": "q"}]
    first = await client.chat.completions.create(model="m", messages=messages, max_tokens=5)
    messages += [first.choices[0].message, {"role": "user", "content": "go on"}]
    second = await client.chat.completions.create(model="m", messages=messages)
    task["seen"] += [first.choices[0].finish_reason, first.choices[0].message.content, second.choices[0].finish_reason]
"""


def test_a_reply_cut_by_max_tokens_is_extended_with_the_eos_as_an_environment_token(
    qwen_tokenizer, scripted_engine, agent_file
):
    engine = scripted_engine(qwen_tokenizer, lambda prompt: "abcdefgh", version=VERSION)
    row: dict[str, Any] = {"seen": []}
    ((ep,),) = run(qwen_tokenizer, engine, f"{agent_file(CUT)}:run", [row])
    assert row["seen"] == ["length", "abcde", "stop"]
    eos = qwen_tokenizer.eos_token_id
    cut, full = qwen_tokenizer.encode("abcde"), [*qwen_tokenizer.encode("abcdefgh"), eos]
    # The template closes the cut turn with its eos: the policy never sampled it, so it is the delta's first token.
    between = [eos, *qwen_tokenizer.encode("\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n")]
    assert ep.token_ids == cut + between + full
    assert ep.mask == [1] * len(cut) + [0] * len(between) + [1] * len(full)
    final = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "abcde"},
        {"role": "user", "content": "go on"},
        {"role": "assistant", "content": "abcdefgh"},
    ]
    assert rendered(qwen_tokenizer, final, []) == ep.prompt_ids + ep.token_ids + qwen_tokenizer.encode("\n")
    assert (ep.counters.prefix_breaks, ep.finish_reason, ep.reward) == (0, "stop", None)

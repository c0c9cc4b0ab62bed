"""The black-box agent runner: many agents at once, each talking to its own session of one local endpoint.

Every episode runs the user's ``async def run(task, client)`` with an ``openai.AsyncOpenAI`` client whose base URL
names the episode's session. The endpoint's generation calls go through one batcher: a call waits only for the
engine's current ``generate`` to end, then joins every call queued meanwhile in the next one (``n = 1`` each), so
a slow or hung agent never holds the others. Each episode is bounded by ``rollout.episode_timeout_s``; an agent
that raises, hangs or returns something other than a number or None is an environment failure
(``rollout.env_failure``), counted like one.
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from relax_services.agents.agent import AgentSpec
from relax_services.agents.chat import ChatTokens
from relax_services.agents.endpoint import ChatEndpoint, HttpError, Reply
from relax_services.agents.parsers import tool_parser, tool_text
from relax_services.agents.runner import AgentConfig, EpisodeRunnerFace
from relax_services.agents.session import AgentSession, AssistantTurn
from relax_services.engines.protocols import Completion, RolloutEngine, WeightPoll
from relax_services.engines.sampling import SamplingParams
from relax_services.models.inputs import text_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from relax_services.agents.episode import Episode
    from relax_services.models.families import ModelFamily

__all__ = ["AgentRunner"]


def _openai() -> types.ModuleType:
    try:
        import openai
    except ImportError as exc:
        raise ImportError(
            "rollout.agent hands each agent an openai.AsyncOpenAI client: install the extra relax-services[agent] "
            "(the openai package)"
        ) from exc
    return openai


class _Batcher:
    """Runs queued generation calls on the engine, all the calls queued while one ``generate`` runs in the next."""

    def __init__(self, engine: RolloutEngine, params: SamplingParams, poll: WeightPoll | None) -> None:
        self.engine, self.params, self.poll = engine, params, poll
        self.pending: list[tuple[list[int], int, asyncio.Future[Completion]]] = []
        self.wake = asyncio.Event()
        self.error: BaseException | None = None
        self.calls: list[int] = []  # prompts per generate call

    async def generate(self, ids: list[int], budget: int) -> Completion:
        future: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self.pending.append((ids, budget, future))
        self.wake.set()
        return await future

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake.clear()
            await asyncio.sleep(0)  # requests read in this turn of the loop join the call
            batch, self.pending = self.pending, []
            if not batch:
                continue
            params = replace(self.params, n=1, max_new_tokens=max(budget for _, budget, _ in batch))
            self.calls.append(len(batch))
            try:
                prompts = [text_prompt(ids) for ids, _, _ in batch]
                outs = await asyncio.to_thread(self.engine.generate, prompts, params, self.poll)
            except Exception as exc:  # the engine failed: the run fails with it (never an agent's fault)
                self.error = exc
                for _, _, future in batch:
                    if not future.done():
                        future.set_exception(HttpError(500, f"generation failed: {exc}", "engine_error"))
                continue
            for (_, _, future), out in zip(batch, outs, strict=True):
                if not future.done():  # its agent may have been cancelled meanwhile
                    future.set_result(out[0])


@dataclass
class _Live:
    """One episode in progress."""

    row: Mapping[str, object]
    session: AgentSession
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    limit: str | None = None  # "max_turns" or "length" once a call was refused for a bound
    closed: bool = False


class AgentRunner(EpisodeRunnerFace):
    """Runs episodes of one black-box agent on one rollout engine.

    Args:
        engine: Generates every call (its weights and versions are the engine's).
        agent: The loaded agent function.
        tokenizer: The checkpoint's tokenizer with its chat template.
        family: The checkpoint's family (its name in errors, its tool parser).
        params: Sampling parameters (``n`` and ``max_new_tokens`` are set per call; a request's temperature and
            top_p are not used: the Trainer's log-probs are at ``params.temperature``); ``eos_id`` must be set.
        config: The episodes' bounds (``max_new_tokens`` caps each call's ``max_tokens``).
        model: The model name the endpoint reports.

    Raises:
        ValueError: ``params`` has no eos, or the family's tool parser is unknown.
        ImportError: the ``openai`` package is missing, naming the extra.
        ChatTemplateError: the chat template cannot extend a conversation exactly, naming the family.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        agent: AgentSpec,
        tokenizer: PreTrainedTokenizerBase,
        family: ModelFamily,
        params: SamplingParams,
        config: AgentConfig | None = None,
        model: str = "relax-policy",
    ) -> None:
        if params.eos_id is None:
            raise ValueError("AgentRunner: params.eos_id must be set (assistant turns end with the eos)")
        self.openai = _openai()
        self.engine, self.agent, self.params, self.model = engine, agent, params, model
        self.config = config or AgentConfig()
        self.chat = ChatTokens(tokenizer, family.name, params.eos_id)
        self.parse = tool_parser(family.tool_parser, family.name)
        self.outside_calls = tool_text(family.tool_parser, family.name)
        self.chat.check_prefix_preserving("user")
        self.batch_sizes: list[int] = []  # prompts per generate call of the last run
        self._batcher: _Batcher | None = None

    @property
    def queued(self) -> int:
        """Generation calls waiting for the engine in the run in progress (0 between runs)."""
        return 0 if self._batcher is None else len(self._batcher.pending)

    def close(self) -> None:
        """Nothing outlives a run (the endpoint and its connections close at its end)."""

    async def run(
        self, rows: Sequence[Mapping[str, object]], group_size: int = 1, poll_weights: WeightPoll | None = None
    ) -> list[list[Episode]]:
        """Runs ``group_size`` episodes of each row, each its own agent call and session, to their end.

        Args:
            rows: Prompt rows' items, each handed to the agent as its ``task``.
            group_size: Episodes per row.
            poll_weights: Passed to every ``generate`` call.

        Returns:
            ``[len(rows)][group_size]`` episodes, in row order.

        Raises:
            Exception: the engine's, when a ``generate`` call failed.
        """
        self._batcher = batcher = _Batcher(self.engine, self.params, poll_weights)
        live: dict[str, _Live] = {}
        for i, row in enumerate(rows):
            for j in range(group_size):
                name = f"ep{i}-{j}-{secrets.token_hex(6)}"
                live[name] = _Live(row, AgentSession(self.chat, self.parse, self.outside_calls, name))
        endpoint = ChatEndpoint(lambda name, route, body: self._handle(live, batcher, name, route, body))
        await endpoint.start()
        worker = asyncio.create_task(batcher.run())
        try:
            await asyncio.gather(*(self._episode(name, lv, endpoint) for name, lv in live.items()))
        finally:
            worker.cancel()
            await endpoint.close()
            self._batcher = None
        self.batch_sizes = batcher.calls
        if batcher.error is not None:
            raise batcher.error
        episodes = [lv.session.episode for lv in live.values()]
        return [episodes[i : i + group_size] for i in range(0, len(episodes), group_size)]

    # -- one episode -------------------------------------------------------------------------------------------

    async def _episode(self, name: str, lv: _Live, endpoint: ChatEndpoint) -> None:
        limit = self.config.episode_timeout_s
        client = self.openai.AsyncOpenAI(base_url=endpoint.base_url(name), api_key=name, max_retries=0, timeout=limit)
        start = time.monotonic()
        try:
            result = await asyncio.wait_for(self.agent.fn(lv.row, client), limit)
            if result is not None and not (isinstance(result, int | float) and math.isfinite(result)):
                raise TypeError(f"returned {result!r:.100} (a reward is a finite number, or None for reward.fn)")
        except TimeoutError:
            why = f"agent {self.agent.name} ran past episode_timeout_s={limit:g} ({time.monotonic() - start:.3g}s)"
            return self._fail(lv, why)
        except Exception as exc:
            return self._fail(lv, f"agent {self.agent.name} raised {type(exc).__name__}: {exc}")
        finally:
            lv.closed = True
            await client.close()
        ep = lv.session.episode
        if not ep.token_ids:
            return self._fail(lv, f"agent {self.agent.name} made no chat-completions call that generated")
        if lv.limit is not None:
            ep.finish_reason = "max_turns" if lv.limit == "max_turns" else "length"
        ep.reward = None if result is None else float(result)

    def _fail(self, lv: _Live, why: str) -> None:
        ep = lv.session.episode
        ep.counters.env_failures += 1
        ep.error = why
        ep.finish_reason = "env_error"
        # An episode without tokens cannot be scored: it is generated again whatever env_failure says.
        ep.requeue = self.config.env_failure == "requeue" or not ep.token_ids
        ep.reward = None if ep.requeue else 0.0

    # -- the endpoint ------------------------------------------------------------------------------------------

    async def _handle(
        self, live: dict[str, _Live], batcher: _Batcher, name: str, route: str, body: dict[str, object]
    ) -> Reply:
        lv = live.get(name)
        if lv is None:
            raise HttpError(401, "unknown session: use the client the agent was given", "invalid_api_key")
        if route == "models":
            return 200, {"object": "list", "data": [{"id": self.model, "object": "model", "owned_by": "relax"}]}
        async with lv.lock:  # one session's calls run in order: each extends the one before
            if lv.closed:
                raise HttpError(409, "the episode of this session is over", "session_closed")
            messages, tools, max_tokens = _request(body)
            session = lv.session
            if session.episode.counters.turns >= self.config.max_turns:
                lv.limit = "max_turns"
                return 200, self._reply(name, None, 0)
            ids = session.prompt(messages, tools)
            room = self.config.max_episode_tokens - len(session.episode.token_ids)
            budget = min(self.config.max_new_tokens, max_tokens or self.config.max_new_tokens, room)
            if budget < 1:
                lv.limit = "length"
                return 200, self._reply(name, None, len(ids))
            out = await batcher.generate(ids, budget)
            if lv.closed:  # the agent timed out while its call was generating
                raise HttpError(409, "the episode of this session is over", "session_closed")
            return 200, self._reply(name, session.record(out, budget), len(ids))

    def _reply(self, name: str, turn: AssistantTurn | None, prompt_tokens: int) -> dict[str, object]:
        """A chat completion in OpenAI's schema (an empty one, finish ``length``, for a call past a bound)."""
        message = turn.message if turn is not None else {"role": "assistant", "content": ""}
        completion = turn.completion_tokens if turn is not None else 0
        return {
            "id": f"chatcmpl-{name}-{secrets.token_hex(4)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": turn.finish_reason if turn is not None else "length",
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": prompt_tokens + completion,
            },
        }


def _request(body: dict[str, object]) -> tuple[list[object], list[dict[str, object]], int | None]:
    """A chat-completions request's messages, tools and ``max_tokens`` (or ``max_completion_tokens``), checked."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise HttpError(400, "'messages' must be a non-empty list of chat messages")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise HttpError(400, "'tools' must be a list of tool objects")
    if body.get("n", 1) != 1:
        raise HttpError(400, f"'n' must be 1 (one session is one episode), got {body.get('n')!r}")
    if body.get("stream"):
        raise HttpError(400, "'stream' is not supported by the agent endpoint")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise HttpError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    return messages, list(tools), max_tokens

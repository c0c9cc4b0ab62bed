"""The episode runner: drives a rollout engine turn by turn over many environment instances.

Every active episode's next assistant turn goes into one batched ``generate`` call (``n = 1`` each: a prompt row's
group of G episodes has G environment instances). Between turns the episodes' tools and ``step`` calls run
concurrently on the event loop (sync methods on the runner's thread pool), each bounded by its timeout; the
environment's messages are appended as the chat template's delta (:mod:`~relax_services.agents.chat`), so every
later prompt extends the earlier one verbatim. Image, audio and video parts of those messages are read by the
checkpoint's data paths (:mod:`~relax_services.agents.media`): their placeholders are expanded in the delta and their
tensors go with every later prompt and with the sample.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Self

from relax_services.agents.chat import ChatTokens, PrefixBreakError
from relax_services.agents.environment import EnvironmentSpec, Message
from relax_services.agents.episode import Episode, EpisodeFinish
from relax_services.agents.media import EpisodeMedia, MediaTurn, UnsupportedMediaError, media_kinds_of
from relax_services.agents.parsers import ToolCall, tool_parser
from relax_services.engines.protocols import Completion, RolloutEngine, WeightPoll
from relax_services.engines.sampling import SamplingParams
from relax_services.models.inputs import join_media

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from relax_modalities.text import PlaceholderSpan
    from relax_services.config.services import RolloutConfig
    from relax_services.models.families import ModelFamily

__all__ = ["AgentConfig", "EpisodeRunner"]

EnvFailure = Literal["zero", "requeue"]


@dataclass(frozen=True)
class AgentConfig:
    """Bounds of the episodes (the ``rollout`` settings of the same names).

    Attributes:
        max_turns: Assistant turns of one episode at most.
        max_new_tokens: Tokens of one assistant turn at most (its eos included).
        max_episode_tokens: Response tokens of one episode at most (assistant and environment).
        max_tool_output_tokens: Tokens of one environment message's text at most (cut in the middle, marked).
        tool_timeout_s: Seconds of one tool call.
        env_timeout_s: Seconds of one ``reset``, ``step``, ``reward`` or ``close`` call.
        episode_timeout_s: Seconds of one episode, generation included.
        env_failure: A failed episode is scored 0 (``zero``) or marked for requeue (``requeue``).
        tool_threads: Threads that run sync tool and environment methods (a hung sync call keeps its thread
            until it returns: Python cannot stop a thread).
    """

    max_turns: int = 4
    max_new_tokens: int = 64
    max_episode_tokens: int = 1024
    max_tool_output_tokens: int = 256
    tool_timeout_s: float = 30.0
    env_timeout_s: float = 60.0
    episode_timeout_s: float = 600.0
    env_failure: EnvFailure = "zero"
    tool_threads: int = 8

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_new_tokens", "max_episode_tokens", "max_tool_output_tokens", "tool_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("tool_timeout_s", "env_timeout_s", "episode_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"AgentConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.env_failure not in ("zero", "requeue"):
            raise ValueError(f"AgentConfig.env_failure must be 'zero' or 'requeue', got {self.env_failure!r}")

    @classmethod
    def from_rollout(cls, cfg: RolloutConfig) -> AgentConfig:
        """The bounds a run's ``rollout`` section sets."""
        return cls(
            max_turns=cfg.max_turns,
            max_new_tokens=cfg.max_new_tokens,
            max_episode_tokens=cfg.max_episode_tokens,
            max_tool_output_tokens=cfg.max_tool_output_tokens,
            tool_timeout_s=cfg.tool_timeout_s,
            env_timeout_s=cfg.env_timeout_s,
            episode_timeout_s=cfg.episode_timeout_s,
            env_failure=cfg.env_failure,
        )


class _EnvFailed(Exception):
    """An environment method raised or hung (the message says which)."""


@dataclass
class _Live:
    """One episode in progress."""

    env: object
    row: Mapping[str, object]
    started: float
    episode: Episode = field(default_factory=Episode)
    history: list[Message] = field(default_factory=list)
    step_reward: float | None = None
    done: bool = False


def _content(result: object) -> str:
    return result if isinstance(result, str) else json.dumps(result)


def _media_parts(result: object) -> list[object] | None:
    """A tool's result as content parts when it shows media: one media part, or a list of typed parts with at least
    one media part; None for any other result (a string or a JSON value)."""
    parts = [result] if isinstance(result, dict) else result
    if not isinstance(parts, list) or not parts:
        return None
    if not all(isinstance(p, dict) and isinstance(p.get("type"), str) for p in parts):
        return None
    return list(parts) if media_kinds_of([{"content": parts}]) else None


def _error(message: str) -> str:
    return json.dumps({"error": message})


class EpisodeRunnerFace:
    """What both runners (:class:`EpisodeRunner`, :class:`~relax_services.agents.agent_runner.AgentRunner`) offer
    besides :meth:`run` and :meth:`close`: a ``with`` block that closes, and :meth:`run_sync`."""

    async def run(
        self, rows: Sequence[Mapping[str, object]], group_size: int = 1, poll_weights: WeightPoll | None = None
    ) -> list[list[Episode]]:
        """Runs ``group_size`` episodes of each row to their end (each runner's own)."""
        raise NotImplementedError

    def close(self) -> None:
        """Releases what the runner holds (each runner's own)."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_sync(
        self, rows: Sequence[Mapping[str, object]], group_size: int = 1, poll_weights: WeightPoll | None = None
    ) -> list[list[Episode]]:
        """:meth:`run` from synchronous code (no event loop running in this thread)."""
        return asyncio.run(self.run(rows, group_size, poll_weights))


class EpisodeRunner(EpisodeRunnerFace):
    """Runs episodes of one environment class on one rollout engine.

    Args:
        engine: Generates each turn (its weights and versions are the engine's).
        env: The loaded environment class.
        tokenizer: The checkpoint's tokenizer with its chat template.
        family: The checkpoint's family (its name in errors, its tool parser).
        params: Sampling parameters (``n`` and ``max_new_tokens`` are set per call); ``eos_id`` must be set.
        config: The episodes' bounds.
        media: Reads the image, audio and video parts of the environment's messages with the checkpoint's data
            paths (:meth:`EpisodeMedia.of_checkpoint`); None: text only (a media part is then an error).

    Raises:
        ValueError: ``params`` has no eos, or the family's tool parser is unknown.
        ChatTemplateError: the chat template cannot extend a conversation exactly, naming the family.
        UnsupportedMediaError: the environment declares a modality the family cannot take (naming both), or any
            modality when ``media`` is None.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        env: EnvironmentSpec,
        tokenizer: PreTrainedTokenizerBase,
        family: ModelFamily,
        params: SamplingParams,
        config: AgentConfig | None = None,
        media: EpisodeMedia | None = None,
    ) -> None:
        if params.eos_id is None:
            raise ValueError("EpisodeRunner: params.eos_id must be set (assistant turns end with the eos)")
        self.engine = engine
        self.env = env
        self.params = params
        self.config = config or AgentConfig()
        self.chat = ChatTokens(tokenizer, family.name, params.eos_id, env.schemas())
        self.parse = tool_parser(family.tool_parser, family.name)
        self.chat.check_prefix_preserving("user" if env.has_step else "tool")
        where = f"rollout.env {env.spec!r} (modalities {env.modalities})"
        if env.modalities and media is None:
            raise UnsupportedMediaError(f"{where}: this runner reads no media (family {family.name})")
        if media is not None:
            media.check(env.modalities, where)
        self.media = media
        self._pool = ThreadPoolExecutor(self.config.tool_threads, thread_name_prefix="relax-env")

    def close(self) -> None:
        """Stops the thread pool (threads still in a hung call end when it returns)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.media is not None:
            self.media.close()

    async def run(
        self, rows: Sequence[Mapping[str, object]], group_size: int = 1, poll_weights: WeightPoll | None = None
    ) -> list[list[Episode]]:
        """Runs ``group_size`` episodes of each row to their end.

        Args:
            rows: Dataset rows, each handed to a fresh environment's ``reset``.
            group_size: Episodes per row (each its own environment instance).
            poll_weights: Passed to every ``generate`` call (weights may change between and within turns).

        Returns:
            ``[len(rows)][group_size]`` episodes, in row order.
        """
        start = time.monotonic()
        live = [_Live(self.env.new(), row, start) for row in rows for _ in range(group_size)]
        await asyncio.gather(*(self._reset(lv) for lv in live))
        active = [lv for lv in live if not lv.done]
        while active:
            budgets = [
                min(self.config.max_new_tokens, self.config.max_episode_tokens - len(lv.episode.token_ids))
                for lv in active
            ]
            params = replace(self.params, n=1, max_new_tokens=max(budgets))
            prompts = [lv.episode.next_prompt() for lv in active]
            outs = await asyncio.to_thread(self.engine.generate, prompts, params, poll_weights)
            turns = zip(active, outs, budgets, strict=True)
            await asyncio.gather(*(self._after_turn(lv, out[0], budget) for lv, out, budget in turns))
            active = [lv for lv in active if not lv.done]
        await asyncio.gather(*(self._finish(lv) for lv in live))
        return [[lv.episode for lv in live[i : i + group_size]] for i in range(0, len(live), group_size)]

    # -- environment calls -------------------------------------------------------------------------------------

    @property
    def _episode_limit(self) -> str:
        return f"episode_timeout_s={self.config.episode_timeout_s:g}"

    def _remaining(self, lv: _Live) -> float:
        return self.config.episode_timeout_s - (time.monotonic() - lv.started)

    async def _call(self, fn: Callable[..., object], timeout: float, *args: object, **kwargs: object) -> object:
        """``fn(*args, **kwargs)``, awaited if async, on the pool if sync; raises TimeoutError past ``timeout``."""
        if asyncio.iscoroutinefunction(fn):
            return await asyncio.wait_for(fn(*args, **kwargs), timeout)
        loop = asyncio.get_running_loop()
        return await asyncio.wait_for(loop.run_in_executor(self._pool, functools.partial(fn, *args, **kwargs)), timeout)

    async def _env_call(self, lv: _Live, name: str, *args: object) -> object:
        remaining = self._remaining(lv)
        if remaining <= 0:
            raise _EnvFailed(f"episode ran past {self._episode_limit}")
        timeout = min(self.config.env_timeout_s, remaining)
        try:
            return await self._call(getattr(lv.env, name), timeout, *args)
        except TimeoutError:
            bound = "" if timeout == self.config.env_timeout_s else f" (the rest of {self._episode_limit})"
            raise _EnvFailed(f"{type(lv.env).__name__}.{name} timed out after {timeout:.3g}s{bound}") from None
        except Exception as exc:
            raise _EnvFailed(f"{type(lv.env).__name__}.{name} raised {type(exc).__name__}: {exc}") from exc

    def _fail(self, lv: _Live, why: str) -> None:
        ep = lv.episode
        ep.counters.env_failures += 1
        ep.error = why
        if not lv.done:
            ep.finish_reason = "env_error"
            lv.done = True
            # An episode without tokens cannot be scored: it is generated again whatever env_failure says.
            ep.requeue = self.config.env_failure == "requeue" or not ep.prompt_ids
            ep.reward = None if ep.requeue else 0.0

    def _end(self, lv: _Live, finish: EpisodeFinish, error: str | None = None) -> None:
        lv.episode.finish_reason = finish
        lv.episode.error = error
        lv.done = True

    async def _reset(self, lv: _Live) -> None:
        try:
            turn = await self._read(_messages(await self._env_call(lv, "reset", lv.row), "reset"), "reset")
            lv.history = turn.messages
            ids, _ = self._expand(self.chat.prompt_ids(lv.history), turn)
            lv.episode.prompt_ids, lv.episode.prompt_media = ids, turn.media
        except Exception as exc:  # the env failed, or its messages cannot be rendered or tokenised (tokenizers
            self._fail(lv, str(exc))  # raise plain Exception for text outside their vocabulary)
        lv.episode.messages = lv.history

    async def _finish(self, lv: _Live) -> None:
        ep = lv.episode
        if ep.finish_reason != "env_error":
            try:
                if self.env.has_reward:
                    value = await self._env_call(lv, "reward")
                    if not isinstance(value, int | float):
                        raise _EnvFailed(f"{type(lv.env).__name__}.reward returned {type(value).__name__}")
                    ep.reward = float(value)
                else:
                    ep.reward = lv.step_reward
            except _EnvFailed as exc:
                lv.done = False  # the episode's tokens stand; its score is the failure's
                self._fail(lv, str(exc))
        if self.env.has_close:
            try:
                await self._env_call(lv, "close")
            except _EnvFailed as exc:
                ep.counters.env_failures += 1
                ep.error = ep.error or str(exc)

    # -- one turn ----------------------------------------------------------------------------------------------

    async def _after_turn(self, lv: _Live, out: Completion, budget: int) -> None:
        ep = lv.episode
        n = min(len(out.token_ids), budget)  # a call's token cap is the largest episode's: trim to this one's
        ep.add_policy(out.token_ids[:n], out.logprobs[:n], out.sampling_logprobs[:n], out.versions[:n])
        ep.counters.turns += 1
        stopped = out.finish_reason == "stop" and n == len(out.token_ids)
        text = self.chat.decode(out.token_ids[: n - 1] if stopped else out.token_ids[:n])
        assistant: Message = {"role": "assistant", "content": text}
        lv.history.append(assistant)
        if not stopped:
            return self._end(lv, "length")
        try:
            new = await self._respond(lv, assistant)
        except _EnvFailed as exc:
            return self._fail(lv, str(exc))
        if new is None:
            return self._end(lv, "stop")
        if ep.counters.turns >= self.config.max_turns:
            return self._end(lv, "max_turns")
        try:
            messages = [self._capped(m) for m in new.messages]
            delta, spans = self._expand(self.chat.delta_ids(lv.history[:-1], assistant, messages), new)
        except PrefixBreakError as exc:
            return self._end(lv, "template", str(exc))
        except Exception as exc:  # the template or tokenizer cannot take the environment's text
            return self._fail(lv, f"the environment's messages cannot be tokenised: {type(exc).__name__}: {exc}")
        if len(ep.token_ids) + len(delta) >= self.config.max_episode_tokens:  # no room for another assistant token
            return self._end(lv, "length")
        ep.add_env(delta, new.media, [(s.modality, s.start, s.length) for s in spans])
        lv.history += messages
        if self._remaining(lv) <= 0:
            self._fail(lv, f"episode ran past {self._episode_limit}")

    async def _respond(self, lv: _Live, assistant: Message) -> MediaTurn | None:
        """The environment's messages (and their media, read) after an assistant turn; None when the episode is
        over."""
        if self.env.has_step:
            result = await self._env_call(lv, "step", assistant)
            if not (isinstance(result, tuple) and len(result) == 3):
                raise _EnvFailed(f"{type(lv.env).__name__}.step must return (messages, reward | None, done)")
            messages, reward, done = result
            if reward is not None:
                if not isinstance(reward, int | float):
                    raise _EnvFailed(f"{type(lv.env).__name__}.step returned a {type(reward).__name__} reward")
                lv.step_reward = float(reward)
            if done:
                return None
            checked = _messages(messages, "step")
            try:
                return await self._read(checked, "step")
            except Exception as exc:  # a media part that cannot be read: the environment's fault
                raise _EnvFailed(f"{type(lv.env).__name__}.step returned media that cannot be read: {exc}") from exc
        calls = self.parse(str(assistant["content"]))
        if not calls:
            return None
        turns = await asyncio.gather(*(self._tool_turn(lv, call) for call in calls))
        return MediaTurn(
            [m for t in turns for m in t.messages],
            [s for t in turns for s in t.slots],
            join_media([t.media for t in turns]),
        )

    async def _tool_turn(self, lv: _Live, call: ToolCall) -> MediaTurn:
        """One tool call's message with its media read; media that cannot be read become the error message the
        model sees (counted as a tool error)."""
        result = await self._tool(lv, call)
        message: Message = {"role": "tool", "name": call.name, "content": result}
        if isinstance(result, str):
            return MediaTurn([message])
        try:
            return await self._read([message], f"tool {call.name!r}")
        except Exception as exc:
            lv.episode.counters.tool_errors += 1
            error = _error(f"tool {call.name!r} returned media that cannot be read: {type(exc).__name__}: {exc}")
            return MediaTurn([{**message, "content": error}])

    async def _read(self, messages: list[Message], where: str) -> MediaTurn:
        """``messages`` with their media read (none: as they are), the decoding on the thread pool (a video's
        frames must not hold the event loop that runs the other episodes).

        Raises:
            UnsupportedMediaError: a media kind the environment did not declare in ``modalities``, or no reader.
            ValueError: a media part that cannot be read.
        """
        kinds = media_kinds_of(messages)
        if not kinds:
            return MediaTurn(messages)
        undeclared = sorted(set(kinds) - set(self.env.modalities))
        if undeclared or self.media is None:
            raise UnsupportedMediaError(
                f"{where} returned {', '.join(undeclared or kinds)} parts, which the environment does not declare "
                f"(its modalities: {self.env.modalities})"
            )
        media = self.media
        return await asyncio.get_running_loop().run_in_executor(self._pool, media.read, messages, where)

    def _expand(self, ids: list[int], turn: MediaTurn) -> tuple[list[int], list[PlaceholderSpan]]:
        """``ids`` with the turn's placeholders expanded to its items' token counts, and the items' spans."""
        if not turn.slots:
            return ids, []
        assert self.media is not None  # a turn has slots only when read by it
        return self.media.expand(ids, turn)

    async def _tool(self, lv: _Live, call: ToolCall) -> str | list[object]:
        """One tool call's result (its content parts when it shows media), or the error message the model sees
        (counted)."""
        counters = lv.episode.counters
        counters.tool_calls += 1
        spec = self.env.tools.get(call.name)
        problem = call.error
        if problem is None and spec is None:
            problem = f"unknown tool {call.name!r}; tools: {sorted(self.env.tools)}"
        if problem is None and spec is not None:
            missing = sorted(set(spec.required) - set(call.arguments))
            unknown = sorted(set(call.arguments) - set(spec.argument_names))
            if missing or unknown:
                problem = f"tool {call.name!r}: missing arguments {missing}, unknown arguments {unknown}"
        if problem is not None:
            counters.tool_errors += 1
            return _error(problem)
        timeout = max(min(self.config.tool_timeout_s, self._remaining(lv)), 1e-3)
        try:
            result = await self._call(getattr(lv.env, call.name), timeout, **call.arguments)
            parts = _media_parts(result)
            return _content(result) if parts is None else parts
        except TimeoutError:
            counters.tool_timeouts += 1
            return _error(f"tool {call.name!r} timed out after {timeout:.3g}s")
        except Exception as exc:  # a raising tool, or a result that is not JSON-able: the model sees it
            counters.tool_errors += 1
            return _error(f"tool {call.name!r} raised {type(exc).__name__}: {exc}")

    def _capped(self, message: Message) -> Message:
        """``message`` with its text cut to ``max_tool_output_tokens``."""
        limit = self.config.max_tool_output_tokens
        content = message.get("content")
        if isinstance(content, str):
            return {**message, "content": self.chat.cap(content, limit)}
        if isinstance(content, list):
            parts = [
                {**p, "text": self.chat.cap(str(p["text"]), limit)}
                if isinstance(p, dict) and p.get("type") == "text" and "text" in p
                else p
                for p in content
            ]
            return {**message, "content": parts}
        return message


def _messages(value: object, method: str) -> list[Message]:
    """An environment method's messages, checked: content a string or a list of typed parts (text, or media that
    :meth:`EpisodeRunner._read` reads)."""
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise _EnvFailed(f"{method} must return chat messages (dicts with 'role' and 'content'), got {value!r:.200}")
    for message in value:
        content = message.get("content")
        parts = content if isinstance(content, list) else []
        untyped = any(not isinstance(p, dict) or not isinstance(p.get("type"), str) for p in parts)
        if not isinstance(content, str | list) or untyped:
            raise _EnvFailed(
                f"{method} returned a message whose content is neither a string nor a list of typed parts "
                f"({{'type': 'text', 'text': ...}}, {{'type': 'image', 'image': ...}}, ...): {content!r:.200}"
            )
    return [dict(m) for m in value]

"""One black-box agent's session: its chat-completions calls turned into one episode with exact tokens.

The agent re-sends the whole conversation at every call. The session renders it with the chat template, each
assistant message it returned earlier replaced by the text that was sampled (tool calls as the model wrote them),
and compares: where the text of the tokens recorded so far (prompt, sampled tokens, earlier deltas) is a prefix of
that rendering, ending at the eos or followed by it, the rest is the environment's delta (the tool results, the
user's next message and the next generation prompt), appended with mask 0; the split falls at the eos, a special
token, so the delta tokenised alone gives the ids the whole rendering has there. Where the recorded tokens are not
a prefix (the agent edited or dropped earlier messages, changed its tools, or the template rewrites earlier turns),
a new sample starts from this call's rendering: the turns before it are context only, never trained on, and the
break is logged and counted (:attr:`~relax_services.agents.EpisodeCounters.prefix_breaks`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from relax_services.agents.chat import ChatTokens
from relax_services.agents.endpoint import HttpError
from relax_services.agents.environment import Message
from relax_services.agents.episode import Episode
from relax_services.agents.parsers import ToolParser
from relax_services.engines.protocols import Completion

__all__ = ["AgentSession", "AssistantTurn"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AssistantTurn:
    """One call's answer.

    Attributes:
        raw: The sampled text without the eos: what the template renders for this turn.
        message: The assistant message in OpenAI's schema (``content`` outside the tool calls, ``tool_calls``).
        finish_reason: ``stop``, ``tool_calls`` or ``length``.
        completion_tokens: Tokens sampled.
    """

    raw: str
    message: dict[str, object]
    finish_reason: str
    completion_tokens: int


def _text(content: object, where: str) -> str:
    """A message's content as text: a string, None, or text parts (joined)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise HttpError(
        400,
        f"{where}: content must be a string or text parts; image, audio and video parts are not "
        "supported by the agent endpoint yet",
    )


def _calls_key(calls: object) -> list[tuple[str, object]]:
    """Tool calls compared by name and parsed arguments (an agent may re-serialise the JSON)."""
    key: list[tuple[str, object]] = []
    for call in calls if isinstance(calls, list) else []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        args = fn.get("arguments") if isinstance(fn, dict) else None
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError:
            parsed = args
        key.append((str(fn.get("name")) if isinstance(fn, dict) else "", parsed))
    return key


def _same_turn(message: Message, turn: AssistantTurn) -> bool:
    if message.get("role") != "assistant":
        return False
    mine = turn.message
    content = message.get("content")
    return _text(content, "assistant") == (mine["content"] or "") and _calls_key(message.get("tool_calls")) == (
        _calls_key(mine.get("tool_calls"))
    )


@dataclass
class AgentSession:
    """The calls of one episode.

    Args:
        chat: The checkpoint's tokenizer and chat template (its ``tools`` are each call's).
        parse: The family's tool-call parser.
        outside_calls: The family's text outside the tool calls.
        name: The session's id (in logs and tool-call ids).
    """

    chat: ChatTokens
    parse: ToolParser
    outside_calls: Callable[[str], str]
    name: str
    episode: Episode = field(default_factory=Episode)
    turns: list[AssistantTurn] = field(default_factory=list)

    def prompt(self, messages: Sequence[object], tools: list[dict[str, object]]) -> list[int]:
        """The prompt ids of a call: the recorded tokens and the delta, or a new sample's prompt (a break).

        Raises:
            HttpError: 400 when a message is not a chat message or the template cannot render the conversation.
        """
        chat = replace(self.chat, tools=tools)
        canonical: list[Message] = []
        unused = 0  # returned turns are matched in order: two equal messages pair with their own sampled texts
        for i, message in enumerate(messages):
            out, unused = self._canonical(message, i, unused)
            canonical.append(out)
        try:
            text = chat.render(canonical, generation_prompt=True)
        except Exception as exc:  # the template raises on what it cannot render (a role, a missing field)
            why = f"the chat template cannot render these messages: {type(exc).__name__}: {exc}"
            raise HttpError(400, why) from exc
        ep = self.episode
        if ep.prompt_ids:
            delta = self._delta(chat.decode(ep.prompt_ids + ep.token_ids), text)
            if delta is not None:
                ep.add_env(chat.encode(delta))
                ep.messages = canonical
                return ep.prompt_ids + ep.token_ids
            log.warning(
                "agent session %s: call %d does not extend the tokens recorded so far (earlier messages or the tools "
                "changed, or the chat template rewrote earlier turns); a new sample starts from this call and the "
                "turns before it are not trained on",
                self.name,
                ep.counters.turns + 1,
            )
            counters = replace(ep.counters, env_tokens=0, prefix_breaks=ep.counters.prefix_breaks + 1)
            self.episode = ep = Episode(counters=counters)
        ep.prompt_ids = chat.encode(text)
        ep.messages = canonical
        return list(ep.prompt_ids)

    def _delta(self, recorded: str, text: str) -> str | None:
        """The text after the recorded tokens, when they are its prefix and the split falls at the eos."""
        eos = self.chat.eos_text
        if not text.startswith(recorded):
            return None
        rest = text[len(recorded) :]
        return rest if recorded.endswith(eos) or rest.startswith(eos) else None

    def _canonical(self, message: object, index: int, unused: int) -> tuple[Message, int]:
        """A message as the template renders it: an assistant turn this session returned (the first one from
        ``turns[unused:]`` it equals) becomes its sampled text; returns it and the next unused turn."""
        where = f"messages[{index}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise HttpError(400, f"{where} must be an object with a string 'role'")
        for k in range(unused, len(self.turns)):
            if _same_turn(message, self.turns[k]):
                return {"role": "assistant", "content": self.turns[k].raw}, k + 1
        out: Message = {k: v for k, v in message.items() if v is not None}
        out["content"] = _text(message.get("content"), where)
        return out, unused

    def record(self, out: Completion, budget: int) -> AssistantTurn:
        """Appends a call's sampled tokens (mask 1) and returns the assistant message the agent receives."""
        ep = self.episode
        n = min(len(out.token_ids), budget)  # the batch's token cap is its largest request's: trim to this one's
        ep.add_policy(out.token_ids[:n], out.logprobs[:n], out.sampling_logprobs[:n], out.versions[:n])
        ep.counters.turns += 1
        stopped = out.finish_reason == "stop" and n == len(out.token_ids)
        raw = self.chat.decode(out.token_ids[: n - 1] if stopped else out.token_ids[:n])
        calls = self.parse(raw)
        good = [c for c in calls if c.error is None]
        ep.counters.tool_calls += len(calls)
        ep.counters.tool_errors += len(calls) - len(good)  # a call the parser cannot read reaches the agent as text
        content = self.outside_calls(raw) if good else raw
        message: dict[str, object] = {"role": "assistant", "content": content or None}
        if good:
            message["tool_calls"] = [
                {
                    "id": f"call_{self.name}_{ep.counters.turns}_{i}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for i, c in enumerate(good)
            ]
        finish = ("tool_calls" if good else "stop") if stopped else "length"
        turn = AssistantTurn(raw, message, finish, n)
        self.turns.append(turn)
        ep.finish_reason = "stop" if stopped else "length"
        ep.messages = [*ep.messages, {"role": "assistant", "content": raw}]
        return turn

"""Exact tokens across turns: the chat template's rendering of environment messages as a delta of token ids.

A turn's prompt is the previous prompt's ids, the sampled tokens verbatim and the ids of the environment's messages.
Those come from the template itself: render the conversation up to the assistant turn (``A``) and with the new
messages and the next generation prompt (``B``); the template must give ``B`` starting with ``A``, and ``A`` must
end the assistant turn with the sampled text, the eos and a separator (Qwen's ``"\\n"``). The delta's text is that
separator plus ``B[len(A):]``; it starts right after the eos, a special token, so tokenising it alone gives the ids
that tokenising the whole of ``B`` gives there. A template that does not keep its earlier rendering (one that drops
past reasoning, say) is found by a probe conversation when the runner is made, and refused naming the family; one
that breaks only for some content is found at that turn, where the episode ends (:class:`PrefixBreakError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from relax_services.agents.environment import Message

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ChatTemplateError", "ChatTokens", "PrefixBreakError"]


class ChatTemplateError(ValueError):
    """The checkpoint's chat template cannot extend a conversation exactly (named with its family)."""


class PrefixBreakError(ValueError):
    """At one turn the template rendered the earlier conversation otherwise than before."""


@dataclass
class ChatTokens:
    """A checkpoint's tokenizer and chat template, rendering episodes' turns as exact token ids.

    Attributes:
        tokenizer: The checkpoint's tokenizer, with its chat template.
        family: The family's name (in errors).
        eos_id: The id that ends an assistant turn (the sampling eos).
        tools: The environment's tools, in the format the template's ``tools`` takes (empty: none shown).
    """

    tokenizer: PreTrainedTokenizerBase
    family: str
    eos_id: int
    tools: list[dict[str, object]] = field(default_factory=list)

    @property
    def eos_text(self) -> str:
        """The eos token's text as the template writes it."""
        return str(self.tokenizer.decode([self.eos_id], skip_special_tokens=False))

    def render(self, messages: Sequence[Message], *, generation_prompt: bool) -> str:
        """The template's text of ``messages`` (with the tools, and the assistant's generation prompt if asked)."""
        # transformers types messages as str-valued dicts; a message's content may also be a list of parts.
        conversation = cast("list[dict[str, str]]", list(messages))
        tools = cast("list[dict[Any, Any]]", self.tools) or None
        text = self.tokenizer.apply_chat_template(
            conversation,
            tools=tools,  # type: ignore[arg-type]
            tokenize=False,
            add_generation_prompt=generation_prompt,
        )
        return str(text)

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` as the template wrote it (its special tokens included, none added)."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        """Text of sampled ids, special tokens kept (what the template renders back)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        """The first turn's prompt: ``messages`` rendered with the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))

    def delta_text(self, history: Sequence[Message], assistant: Message, new: Sequence[Message]) -> str:
        """The text that follows an assistant turn's eos when ``new`` messages and the next generation prompt are
        appended to ``history + [assistant]``.

        Raises:
            PrefixBreakError: the template renders the earlier conversation otherwise with the new messages, or
                does not end the assistant turn with its content and the eos.
        """
        before = self.render(history, generation_prompt=True)
        done = self.render([*history, assistant], generation_prompt=False)
        after = self.render([*history, assistant, *new], generation_prompt=True)
        turn = f"{assistant['content']}{self.eos_text}"
        if not done.startswith(before) or not done[len(before) :].startswith(turn):
            raise PrefixBreakError(
                f"family {self.family}: the chat template does not render the assistant turn as its sampled text and "
                f"the eos {self.eos_text!r} after the generation prompt"
            )
        if not after.startswith(done):
            raise PrefixBreakError(
                f"family {self.family}: the chat template renders the conversation before the new messages otherwise "
                "once they are added"
            )
        return done[len(before) + len(turn) :] + after[len(done) :]

    def delta_ids(self, history: Sequence[Message], assistant: Message, new: Sequence[Message]) -> list[int]:
        """Ids of :meth:`delta_text` (they follow the sampled eos verbatim)."""
        return self.encode(self.delta_text(history, assistant, new))

    def check_prefix_preserving(self, env_role: str) -> None:
        """Runs a probe episode through the template: two assistant turns, each followed by a message of
        ``env_role`` (``tool`` for a tool set, ``user`` for a ``step`` environment).

        Raises:
            ChatTemplateError: naming the family, when the template rewrites earlier turns or does not end an
                assistant turn with the eos.
        """
        env: Message = {"role": env_role, "content": "1"}
        if env_role == "tool":
            env["name"] = "probe"
        history: list[Message] = [{"role": "user", "content": "2"}]
        try:
            for content in ("3", "4"):
                assistant: Message = {"role": "assistant", "content": content}
                self.delta_text(history, assistant, [env])
                history += [assistant, env]
        except PrefixBreakError as exc:
            raise ChatTemplateError(
                f"{exc}; multi-turn episodes need a template that keeps every earlier turn as it rendered it "
                "(extend the prompt with the sampled tokens verbatim), so this family cannot run rollout.env"
            ) from exc
        except Exception as exc:  # the template raised on a probe conversation (e.g. an unsupported role)
            raise ChatTemplateError(
                f"family {self.family}: the chat template cannot render a {env_role!r} message after an assistant "
                f"turn ({type(exc).__name__}: {exc})"
            ) from exc

    def cap(self, text: str, max_tokens: int) -> str:
        """``text`` cut in the middle to ``max_tokens`` tokens when longer, the cut marked with its size."""
        ids = self.encode(text)
        if len(ids) <= max_tokens:
            return text
        head = max_tokens // 2
        tail = max_tokens - head
        cut = len(ids) - max_tokens
        return f"{self.decode(ids[:head])}\n... {cut} tokens cut ...\n{self.decode(ids[len(ids) - tail :])}"

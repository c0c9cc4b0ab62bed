"""Chat builder: renders one user turn with modality placeholder spans of the right length."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from relax_modalities.text._tokenizer import Tokenizer

Modality = Literal["image", "video", "audio"]
"""The built-in media modalities (a registered modality of relax-modalities' `MODALITY_PATHS` may add more)."""
MODALITIES: tuple[Modality, ...] = ("image", "video", "audio")


@dataclass(frozen=True)
class ChatTemplate:
    """Strings a chat is rendered with; defaults are the tiny vocabulary's, `qwen()` the real model's.

    The tiny layout is ``<|bos|><|user|>[media blocks]prompt<|assistant|>``, then
    the response ended by ``<|eos|>``.

    Attributes:
        user_prefix: opens the user turn.
        turn_end: closes the user turn (empty for the tiny layout).
        assistant_prefix: opens the assistant turn (the generation prompt).
        response_end: closes an assistant response (its eos).
        system_prefix: opens a system turn; ``None`` when the template has no system turn.
        vision_start: starts an image or video span.
        vision_end: ends an image or video span.
        image_pad: one image placeholder token.
        video_pad: one video placeholder token.
        audio_start: starts an audio span.
        audio_end: ends an audio span.
        audio_pad: one audio placeholder token.
        extra_spans: ``(modality, start, pad, end)`` strings of modalities beyond image, video and audio.
    """

    user_prefix: str = "<|bos|><|user|>"
    turn_end: str = ""
    assistant_prefix: str = "<|assistant|>"
    response_end: str = "<|eos|>"
    system_prefix: str | None = None
    vision_start: str = "<|vision_start|>"
    vision_end: str = "<|vision_end|>"
    image_pad: str = "<|image_pad|>"
    video_pad: str = "<|video_pad|>"
    audio_start: str = "<|audio_start|>"
    audio_end: str = "<|audio_end|>"
    audio_pad: str = "<|audio_pad|>"
    extra_spans: tuple[tuple[str, str, str, str], ...] = ()

    def spans(self) -> dict[str, tuple[str, str, str]]:
        """Modality → its ``(start, pad, end)`` span strings."""
        out = {
            "image": (self.vision_start, self.image_pad, self.vision_end),
            "video": (self.vision_start, self.video_pad, self.vision_end),
            "audio": (self.audio_start, self.audio_pad, self.audio_end),
        }
        out.update({name: (start, pad, end) for name, start, pad, end in self.extra_spans})
        return out

    @classmethod
    def qwen(cls) -> ChatTemplate:
        """The Qwen2.5-Omni chat template strings (for the real tokenizer)."""
        return cls(
            user_prefix="<|im_start|>user\n",
            turn_end="<|im_end|>\n",
            assistant_prefix="<|im_start|>assistant\n",
            response_end="<|im_end|>",
            system_prefix="<|im_start|>system\n",
            image_pad="<|IMAGE|>",
            video_pad="<|VIDEO|>",
            audio_start="<|audio_bos|>",
            audio_end="<|audio_eos|>",
            audio_pad="<|AUDIO|>",
        )


TINY_TEMPLATE = ChatTemplate()


@dataclass(frozen=True)
class MediaSlot:
    """One media item of a user turn: its modality and how many placeholder tokens the model expects.

    Attributes:
        modality: ``"image"``, ``"video"``, ``"audio"`` or another registered modality's name (the chat builders
            refuse a modality they have no placeholder for).
        num_tokens: placeholder count (image/video: ``prod(grid_thw) // merge**2``;
            audio: the encoder's output length).
        interleave: only for a video with its sound track (Qwen2.5-Omni's ``use_audio_in_video``):
            ``(video_tokens, audio_tokens)`` per time chunk, rendered as
            ``vision_start audio_start [video × v_j, audio × a_j]… audio_end vision_end``.
        frames: only for a video in the timestamped-frames layout (Qwen3-VL's): ``(text, tokens)`` per temporal
            grid step, rendered as ``text vision_start video × tokens vision_end`` each, all in place of the one
            video placeholder (inside the template's own vision markers, as transformers' processor expands it).
    """

    modality: str
    num_tokens: int
    interleave: tuple[tuple[int, int], ...] | None = None
    frames: tuple[tuple[str, int], ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.modality, str) or not self.modality:
            raise ValueError(f"MediaSlot.modality must be a modality name, got {self.modality!r}")
        if self.num_tokens < 1:
            raise ValueError(f"MediaSlot.num_tokens must be >= 1, got {self.num_tokens}")
        if self.interleave is not None:
            if self.modality != "video":
                raise ValueError("MediaSlot.interleave is only for video slots")
            if sum(v for v, _ in self.interleave) != self.num_tokens:
                raise ValueError(
                    f"MediaSlot.interleave video tokens sum to {sum(v for v, _ in self.interleave)}, "
                    f"not num_tokens {self.num_tokens}"
                )
        if self.frames is not None:
            if self.modality != "video" or self.interleave is not None:
                raise ValueError("MediaSlot.frames is only for video slots without interleave")
            if (
                not self.frames
                or any(n < 1 for _, n in self.frames)
                or sum(n for _, n in self.frames) != self.num_tokens
            ):
                raise ValueError(
                    f"MediaSlot.frames must give >= 1 token per block, summing to num_tokens {self.num_tokens}; "
                    f"got {[n for _, n in self.frames]}"
                )


@dataclass(frozen=True)
class PlaceholderSpan:
    """Where one media item's placeholder tokens sit in ``input_ids`` (``start`` inclusive)."""

    modality: str
    start: int
    length: int


@dataclass
class ChatPrompt:
    """A rendered prompt.

    Attributes:
        input_ids: token ids of the whole prompt, ending with the generation prompt.
        spans: placeholder span of each media item, in the order given.
    """

    input_ids: list[int]
    spans: list[PlaceholderSpan] = field(default_factory=list)


class ChatBuilder:
    """Renders chats to ids with a tokenizer and a template; special ids are resolved once.

    Args:
        tokenizer: anything satisfying the `Tokenizer` protocol.
        template: the chat strings; every special string must be a single token of ``tokenizer``.
    """

    def __init__(self, tokenizer: Tokenizer, template: ChatTemplate = TINY_TEMPLATE) -> None:
        self.tokenizer = tokenizer
        self.template = template
        t = template
        self._span_ids: dict[str, tuple[int, int, int]] = {
            name: (self._single(start), self._single(pad), self._single(end))
            for name, (start, pad, end) in t.spans().items()
        }
        self._system_ids = None if t.system_prefix is None else tokenizer.encode(t.system_prefix)
        self._user_ids = tokenizer.encode(t.user_prefix)
        self._assistant_ids = tokenizer.encode(t.assistant_prefix)
        self._turn_end_ids = tokenizer.encode(t.turn_end)
        self._response_end_ids = tokenizer.encode(t.response_end)

    def _single(self, token: str) -> int:
        ids = self.tokenizer.encode(token)
        if len(ids) != 1:
            raise ValueError(f"chat template token {token!r} is not a single token of the tokenizer (got ids {ids})")
        return ids[0]

    def placeholder_id(self, modality: str) -> int:
        """Id of the placeholder token of ``modality``."""
        return self._span(modality)[1]

    def _span(self, modality: str) -> tuple[int, int, int]:
        try:
            return self._span_ids[modality]
        except KeyError:
            raise ValueError(
                f"this chat template has no span for modality {modality!r} (ChatTemplate.extra_spans adds one)"
            ) from None

    def build(
        self,
        user_text: str,
        media: Sequence[MediaSlot] = (),
        *,
        system: str | None = None,
        add_generation_prompt: bool = True,
    ) -> ChatPrompt:
        """Render one user turn (media spans first, then text) and the assistant prefix.

        Args:
            user_text: the user's question.
            media: media items, each rendered as ``start, pad × num_tokens, end``.
            system: optional system message (only for templates with a system turn).
            add_generation_prompt: append the assistant prefix so the model answers next.

        Returns:
            The ids and the placeholder span of each media item.
        """
        ids: list[int] = []
        if system is not None:
            if self._system_ids is None:
                raise ValueError("this chat template has no system turn (ChatTemplate.system_prefix is None)")
            ids += self._system_ids + self.tokenizer.encode(system) + self._turn_end_ids
        ids += self._user_ids
        spans: list[PlaceholderSpan] = []
        for slot in media:
            if slot.interleave is not None:
                self._interleaved(slot.interleave, ids, spans)
                continue
            start_id, pad_id, end_id = self._span(slot.modality)
            ids.append(start_id)
            if slot.frames is not None:
                _frame_blocks(slot.frames, self.tokenizer.encode, (start_id, pad_id, end_id), ids, spans)
                ids.append(end_id)
                continue
            spans.append(PlaceholderSpan(slot.modality, len(ids), slot.num_tokens))
            ids += [pad_id] * slot.num_tokens
            ids.append(end_id)
        ids += self.tokenizer.encode(user_text) + self._turn_end_ids
        if add_generation_prompt:
            ids += self._assistant_ids
        return ChatPrompt(input_ids=ids, spans=spans)

    def _interleaved(self, chunks: Sequence[tuple[int, int]], ids: list[int], spans: list[PlaceholderSpan]) -> None:
        vision_start, video_pad, vision_end = self._span_ids["video"]
        audio_start, audio_pad, audio_end = self._span_ids["audio"]
        ids += [vision_start, audio_start]
        for n_video, n_audio in chunks:
            pieces: tuple[tuple[str, int, int], ...] = (
                ("video", video_pad, n_video),
                ("audio", audio_pad, n_audio),
            )
            for modality, pad, n in pieces:
                if n > 0:
                    spans.append(PlaceholderSpan(modality, len(ids), n))
                    ids += [pad] * n
        ids += [audio_end, vision_end]

    def response_ids(self, response: str) -> list[int]:
        """Ids of an assistant response followed by the response end (eos)."""
        return self.tokenizer.encode(response) + self._response_end_ids


def _frame_blocks(
    frames: Sequence[tuple[str, int]],
    encode: Callable[[str], list[int]],
    markers: tuple[int, int, int],
    ids: list[int],
    spans: list[PlaceholderSpan],
) -> None:
    """Appends ``text vision_start pad × n vision_end`` per ``(text, n)`` block, one span per block. The text is
    encoded on its own: it sits between special tokens, which tokenizers split out before encoding the text
    between them, so this equals encoding the expanded prompt in one piece."""
    start, pad, end = markers
    for text, n in frames:
        ids += encode(text)
        ids.append(start)
        spans.append(PlaceholderSpan("video", len(ids), n))
        ids += [pad] * n
        ids.append(end)


def build_chat(
    tokenizer: Tokenizer,
    user_text: str,
    media: Sequence[MediaSlot] = (),
    *,
    system: str | None = None,
    template: ChatTemplate = TINY_TEMPLATE,
    add_generation_prompt: bool = True,
) -> ChatPrompt:
    """One-shot form of `ChatBuilder.build` (build a `ChatBuilder` once when rendering many prompts)."""
    builder = ChatBuilder(tokenizer, template)
    return builder.build(user_text, media, system=system, add_generation_prompt=add_generation_prompt)


class ChatTemplateTokenizer(Tokenizer, Protocol):
    """A `Tokenizer` that also renders chats with its own (Jinja) chat template, as transformers' tokenizers do."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any:
        """Render ``conversation`` (a list of ``{"role", "content"}`` messages)."""
        ...


@dataclass(frozen=True)
class CheckpointTemplate:
    """Render with the tokenizer's own chat template; the ids of the media tokens it emits come from the model.

    The template renders each media part (``{"type": "image"}`` …) as one placeholder token, as transformers'
    processors expect; `TemplateChat` then expands it to the item's token count.

    Attributes:
        placeholders: ``(role, id)`` pairs: ``image``, ``video``, ``audio`` placeholders and the ``vision_start``,
            ``vision_end``, ``audio_start``, ``audio_end`` markers the checkpoint has (from its model config).
    """

    placeholders: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(cls, placeholders: Mapping[str, int]) -> CheckpointTemplate:
        """From a role → id mapping."""
        return cls(tuple(sorted(placeholders.items())))


class TemplateChat:
    """Renders a user turn through the tokenizer's chat template and expands each media placeholder.

    Same interface as `ChatBuilder`. A video slot with ``interleave`` replaces its video placeholder by
    ``audio_start [video × v_j, audio × a_j]… audio_end`` inside the template's vision markers; one with ``frames``
    by ``text vision_start video × n vision_end`` per temporal grid step (Qwen3-VL's processor's expansion).

    Args:
        tokenizer: a tokenizer with a chat template (``apply_chat_template``).
        template: the checkpoint's placeholder ids.
        modalities: the modality names whose placeholders are expanded (each the role of its placeholder id in
            ``template``); the sample processor passes every registered modality.

    Raises:
        ValueError: when the tokenizer has no chat template.
    """

    def __init__(
        self, tokenizer: ChatTemplateTokenizer, template: CheckpointTemplate, modalities: Sequence[str] = MODALITIES
    ) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; render prompts with a ChatTemplate (plain strings) instead"
            )
        self.tokenizer = tokenizer
        self.ids = dict(template.placeholders)
        self._modality_of = {self.ids[m]: m for m in modalities if m in self.ids}
        eos = getattr(tokenizer, "eos_token_id", None)
        self._response_end_ids = [] if eos is None else [int(eos)]

    def placeholder_id(self, modality: str) -> int:
        """Id of the placeholder token of ``modality``."""
        try:
            return self.ids[modality]
        except KeyError:
            raise ValueError(f"this checkpoint has no {modality} placeholder") from None

    def build(
        self,
        user_text: str,
        media: Sequence[MediaSlot] = (),
        *,
        system: str | None = None,
        add_generation_prompt: bool = True,
    ) -> ChatPrompt:
        """Render one user turn (media parts first, then text) and the generation prompt.

        Raises:
            ValueError: when the template renders a different number of placeholders than there are media items.
        """
        content: list[dict[str, str]] = [{"type": slot.modality} for slot in media]
        content.append({"type": "text", "text": user_text})
        messages: list[dict[str, Any]] = [] if system is None else [{"role": "system", "content": system}]
        messages.append({"role": "user", "content": content})
        return self.render(messages, media, add_generation_prompt=add_generation_prompt)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        media: Sequence[MediaSlot] = (),
        *,
        add_generation_prompt: bool = True,
    ) -> ChatPrompt:
        """Render a whole chat (``{"role", "content"}`` messages, content a string or typed parts such as
        ``{"type": "image"}``) and expand the ``i``-th media placeholder the template emits to ``media[i]``.

        Raises:
            ValueError: when the template renders a different number of placeholders than there are media items,
                or in another order.
        """
        for slot in media:
            self.placeholder_id(slot.modality)
        text = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=add_generation_prompt
        )
        rendered: list[int] = list(self.tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]
        return self.expand(rendered, media)

    def expand(self, rendered: Sequence[int], media: Sequence[MediaSlot] = ()) -> ChatPrompt:
        """Expand the ``i``-th media placeholder of already rendered ids to ``media[i]`` (what `render` does after
        the template; a multi-turn episode renders each environment turn as a delta of the template's text and
        expands the delta's placeholders with the media of that turn only).

        Raises:
            ValueError: when ``rendered`` holds a different number of placeholders than there are media items, or
                in another order.
        """
        ids: list[int] = []
        spans: list[PlaceholderSpan] = []
        pending = list(media)
        for token in rendered:
            modality = self._modality_of.get(token)
            if modality is None:
                ids.append(token)
                continue
            if not pending or pending[0].modality != modality:
                raise ValueError(
                    f"the chat template rendered a {modality} placeholder where the prompt's media are "
                    f"{[s.modality for s in media]}"
                )
            slot = pending.pop(0)
            if slot.interleave is not None:
                self._interleaved(slot.interleave, ids, spans)
            elif slot.frames is not None:
                self._frames(slot.frames, token, ids, spans)
            else:
                spans.append(PlaceholderSpan(modality, len(ids), slot.num_tokens))
                ids += [token] * slot.num_tokens
        if pending:
            raise ValueError(f"the chat template rendered no placeholder for {len(pending)} media item(s)")
        return ChatPrompt(input_ids=ids, spans=spans)

    def _frames(
        self, frames: Sequence[tuple[str, int]], pad: int, ids: list[int], spans: list[PlaceholderSpan]
    ) -> None:
        for role in ("vision_start", "vision_end"):
            if role not in self.ids:
                raise ValueError(f"this checkpoint has no {role} marker, which a timestamped-frames video needs")

        def encode(text: str) -> list[int]:
            return list(self.tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]

        _frame_blocks(frames, encode, (self.ids["vision_start"], pad, self.ids["vision_end"]), ids, spans)

    def _interleaved(self, chunks: Sequence[tuple[int, int]], ids: list[int], spans: list[PlaceholderSpan]) -> None:
        video_pad, audio_pad = self.placeholder_id("video"), self.placeholder_id("audio")
        ids.append(self.ids["audio_start"])
        for n_video, n_audio in chunks:
            pieces: tuple[tuple[str, int, int], ...] = (
                ("video", video_pad, n_video),
                ("audio", audio_pad, n_audio),
            )
            for modality, pad, n in pieces:
                if n > 0:
                    spans.append(PlaceholderSpan(modality, len(ids), n))
                    ids += [pad] * n
        ids.append(self.ids["audio_end"])

    def response_ids(self, response: str) -> list[int]:
        """Ids of an assistant response followed by the tokenizer's eos."""
        return list(self.tokenizer.encode(response, add_special_tokens=False)) + self._response_end_ids  # type: ignore[call-arg]

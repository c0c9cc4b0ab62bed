"""One multi-turn episode's result: its tokens with their mask, behaviour log-probs and versions, how it ended,
its reward and counters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from relax_services.agents.environment import Message
from relax_services.engines.protocols import Completion, MediaSpan
from relax_services.models.inputs import OmniPrompt, join_media

__all__ = ["EPISODE_FINISHES", "Episode", "EpisodeCounters", "EpisodeFinish"]

EpisodeFinish = Literal["stop", "length", "max_turns", "env_error", "template"]
EPISODE_FINISHES: tuple[str, ...] = ("stop", "length", "max_turns", "env_error", "template")


@dataclass
class EpisodeCounters:
    """What happened in one episode.

    Attributes:
        turns: Assistant turns generated.
        tool_calls: Tool calls the model made (read or not).
        tool_errors: Calls answered with an error: bad JSON, an unknown tool, wrong arguments, a raising tool or a
            result that is not JSON-able.
        tool_timeouts: Calls that ran past ``rollout.tool_timeout_s`` (answered with an error too).
        env_tokens: Environment and tool tokens in the response (mask 0).
        env_failures: Environment methods (``reset``, ``step``, ``reward``, ``close``) that raised or hung, and
            episodes over ``rollout.episode_timeout_s``; for a black-box agent, an agent that raised or ran past
            it.
        prefix_breaks: Black-box agent calls whose conversation did not extend the tokens recorded before them: a
            new sample started there (the turns before it are context, not trained on).
    """

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    env_tokens: int = 0
    env_failures: int = 0
    prefix_breaks: int = 0


@dataclass
class Episode:
    """One episode of one environment instance: the first prompt and every later token as one response.

    Attributes:
        prompt_ids: ``[P]`` the first turn's prompt (``reset``'s messages rendered with the tools); empty when
            ``reset`` failed.
        token_ids: ``[L]`` every token after the prompt: the assistant's sampled tokens verbatim and the
            environment's messages rendered by the chat template.
        logprobs: ``[L]`` behaviour log-prob of each assistant token; 0 on environment tokens.
        sampling_logprobs: ``[L]`` log-prob under the distribution each assistant token was drawn from; 0 on
            environment tokens.
        versions: ``[L]`` policy version of each assistant token; an environment token has the version of the
            token before it.
        mask: ``[L]`` 1 on the policy's tokens, 0 on the environment's.
        finish_reason: ``stop`` (a final answer, or ``step`` said done), ``length`` (an assistant turn reached
            ``rollout.max_new_tokens`` without its eos, or the episode ``rollout.max_episode_tokens``),
            ``max_turns``, ``env_error`` (the environment raised or hung), ``template`` (the chat template rewrote
            earlier turns at this turn's content; the tokens so far are exact).
        reward: ``env.reward()`` when the environment defines it, else the last reward ``step`` gave, else None
            (the run's ``reward.fn`` scores :attr:`messages`); 0 for a failed episode under
            ``env_failure=zero``.
        requeue: The episode failed under ``env_failure=requeue`` (or failed in ``reset``, when it has no tokens
            to score): generate its row again instead of training on it.
        error: What failed (``env_error``, ``template``), else None.
        messages: The conversation: ``reset``'s messages, each assistant turn's text and the environment's
            messages, for ``reward.fn``.
        counters: What happened.
        prompt_media: Forward kwargs of the media of ``reset``'s messages (their placeholders are in
            ``prompt_ids``).
        media: Forward kwargs of the media the environment returned after the first turn, in conversation order
            (their placeholders are environment tokens of ``token_ids``).
        media_spans: ``(modality, start, length)`` of each of those items' placeholder run in ``token_ids``.
    """

    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    finish_reason: EpisodeFinish = "length"
    reward: float | None = None
    requeue: bool = False
    error: str | None = None
    messages: list[Message] = field(default_factory=list)
    counters: EpisodeCounters = field(default_factory=EpisodeCounters)
    prompt_media: dict[str, torch.Tensor] = field(default_factory=dict)
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    media_spans: list[MediaSpan] = field(default_factory=list)

    def next_prompt(self) -> OmniPrompt:
        """The next turn's prompt: the first prompt and every token so far, with every media item so far."""
        return OmniPrompt(self.prompt_ids + self.token_ids, **join_media([self.prompt_media, self.media]))

    def sample_prompt(self) -> OmniPrompt:
        """The sample row's prompt: ``prompt_ids`` with every media item of the episode in conversation order, the
        first ones filling the prompt's placeholders and the rest the response's (the scoring path runs a response
        with media placeholders through one forward of the whole conversation)."""
        return OmniPrompt(self.prompt_ids, **join_media([self.prompt_media, self.media]))

    def add_policy(
        self, token_ids: list[int], logprobs: list[float], sampling: list[float], versions: list[int]
    ) -> None:
        """Appends an assistant turn's sampled tokens (mask 1)."""
        self.token_ids += token_ids
        self.logprobs += logprobs
        self.sampling_logprobs += sampling
        self.versions += versions
        self.mask += [1] * len(token_ids)

    def add_env(
        self,
        token_ids: list[int],
        media: Mapping[str, torch.Tensor] | None = None,
        spans: Sequence[MediaSpan] = (),
    ) -> None:
        """Appends environment tokens (mask 0, log-prob 0, the version of the token before them), and the media
        whose placeholders they hold (``spans`` relative to ``token_ids``)."""
        version = self.versions[-1] if self.versions else 0
        n = len(token_ids)
        if media:
            self.media = join_media([self.media, media])
        offset = len(self.token_ids)
        self.media_spans += [(kind, offset + start, length) for kind, start, length in spans]
        self.token_ids += token_ids
        self.logprobs += [0.0] * n
        self.sampling_logprobs += [0.0] * n
        self.versions += [version] * n
        self.mask += [0] * n
        self.counters.env_tokens += n

    def to_completion(self) -> Completion:
        """The episode as a rollout :class:`~relax_services.engines.Completion` with its per-token mask (1 on the
        policy's tokens, 0 on the environment's: the Trainer trains on the first only)."""
        return Completion(
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            sampling_logprobs=list(self.sampling_logprobs),
            versions=list(self.versions),
            finish_reason="stop" if self.finish_reason == "stop" else "length",
            mask=list(self.mask),
            media=dict(self.media),
            media_spans=list(self.media_spans),
        )

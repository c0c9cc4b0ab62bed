"""Contracts between the services and their engines.

A rollout engine turns prompts into sampled completions with behaviour log-probs and per-token policy
versions; a training engine turns scored samples into optimizer updates. The built-in engines are
:class:`~relax_services.engines.HFRolloutEngine` and :class:`~relax_services.engines.TorchTrainEngine`;
vLLM and megatron-core engines implement the same protocols later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch

from relax_services.engines.sampling import SamplingParams
from relax_services.engines.scoring import TokenScores
from relax_services.models.inputs import OmniPrompt

FinishReason = Literal["stop", "length"]
PartialRolloutMode = Literal["finish_old", "switch", "abort_resume"]
PARTIAL_ROLLOUT_MODES: tuple[str, ...] = ("finish_old", "switch", "abort_resume")
MediaSpan = tuple[str, int, int]
"""``(modality, start, length)``: one media item's run of placeholder tokens in a response."""

LOSS_MASK_FIELD = "loss_mask"
"""The :class:`TrainSample` field that marks the tokens a loss trains on: ``[L]``, 1 on the policy's own tokens, 0 on
environment and tool tokens a multi-turn rollout spliced into the response (context only). Engines multiply their
scoring mask by it, so :attr:`LossInputs.mask`, the micro-batch weights and the engine's token metrics count policy
tokens only; a sample without it trains on every response token."""

WeightPoll = Callable[[], "tuple[int, Mapping[str, torch.Tensor]] | None"]
"""Returns ``(version, state_dict)`` when weights newer than the engine's are available, else ``None``."""


@dataclass
class Completion:
    """One sampled completion of one prompt.

    Attributes:
        token_ids: Response ids; ends with ``eos_id`` when ``finish_reason == "stop"``.
        logprobs: Behaviour log-prob of each token under the policy distribution
            ``log_softmax(logits / T)`` over the non-suppressed vocabulary (before top-k/top-p), the
            distribution the training engine recomputes.
        sampling_logprobs: Log-prob of each token under the truncated (top-k/top-p) distribution it was
            actually drawn from; equal to ``logprobs`` when no truncation is set; 0 for greedy.
        versions: Policy version of the weights that produced each token.
        finish_reason: ``"stop"`` (eos sampled) or ``"length"`` (``max_new_tokens`` reached).
        num_restarts: Times the completion was aborted and restarted from the prompt (``abort_resume``).
        mask: Per-token loss mask: 1 on a token the policy sampled, 0 on an environment or tool token spliced in
            between turns (its ``logprobs`` entry is 0 and it is context only: no loss, estimator or ratio reads
            it). Empty means every token is the policy's (:attr:`loss_mask` gives the mask in full).
        media: Forward kwargs of media an environment returned between turns (``pixel_values``,
            ``input_features``, ...), in conversation order; their placeholders are environment tokens of
            :attr:`token_ids`. Empty for a single-turn completion.
        media_spans: ``(modality, start, length)`` of each of those items' placeholder run in :attr:`token_ids`.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    sampling_logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    num_restarts: int = 0
    mask: list[int] = field(default_factory=list)
    media: dict[str, torch.Tensor] = field(default_factory=dict)
    media_spans: list[MediaSpan] = field(default_factory=list)

    @property
    def loss_mask(self) -> list[int]:
        """``[L]`` the effective mask: :attr:`mask`, or all ones when it is empty.

        Raises:
            ValueError: If :attr:`mask` is set with a length other than the response's, or holds values other
                than 0 and 1.
        """
        if not self.mask:
            return [1] * len(self.token_ids)
        if len(self.mask) != len(self.token_ids):
            raise ValueError(f"Completion.mask has {len(self.mask)} entries for {len(self.token_ids)} tokens")
        if any(m not in (0, 1) for m in self.mask):
            raise ValueError("Completion.mask holds 1 (policy token) or 0 (environment token) per token")
        return list(self.mask)

    @property
    def version_range(self) -> tuple[int, int]:
        """``(v_min, v_max)`` over the tokens."""
        return min(self.versions), max(self.versions)


def generation_stats(out: list[Completion], elapsed: float, **counters: float) -> dict[str, float]:
    """An engine's ``last_stats`` for one generate call: completions and tokens, their rates, and the engine's
    own ``counters`` (decode steps, forwards, weight switches, ...)."""
    n_tokens = sum(len(c.token_ids) for c in out)
    return {
        "generate_s": elapsed,
        "completions": float(len(out)),
        "completions_per_s": len(out) / elapsed,
        "tokens": float(n_tokens),
        "tokens_per_s": n_tokens / elapsed,
        **{k: float(v) for k, v in counters.items()},
    }


@runtime_checkable
class ReleasesWeights(Protocol):
    """A rollout engine that can drop the weights it computes with until its next ``load_weights``
    (:meth:`HFRolloutEngine.release_weights <relax_services.engines.hf.rollout.HFRolloutEngine.release_weights>`)."""

    def release_weights(self) -> bool:
        """Drops the loaded version's tensors if they are the published ones; returns whether it did."""
        ...


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates completions; weights change only at safe points between decode steps."""

    @property
    def version(self) -> int:
        """Policy version of the weights currently loaded."""
        ...

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replaces the weights (between generate calls) and tags later tokens with ``version``."""
        ...

    def seed(self, seed: int) -> None:
        """Reseeds the sampling RNG: the next :meth:`generate` call with the same prompts, parameters and weights
        draws the same completions (the rollout service seeds each call from the run seed and its prompt keys)."""
        ...

    def generate(
        self,
        prompts: Sequence[OmniPrompt],
        params: SamplingParams,
        poll_weights: WeightPoll | None = None,
    ) -> list[list[Completion]]:
        """Samples ``params.n`` completions per prompt.

        Args:
            prompts: Prompts, batched together.
            params: Sampling parameters.
            poll_weights: Called at safe points; newer weights it returns are applied per the engine's
                partial-rollout mode.

        Returns:
            ``[len(prompts)][params.n]`` completions, in prompt order.
        """
        ...


@dataclass
class TrainSample:
    """One scored sample for the training engine.

    Attributes:
        prompt: The prompt the response was generated from (media included).
        response_ids: ``[L]`` response ids.
        fields: Per-token ``[L, ...]`` (e.g. ``[L]`` advantages, behaviour or reference log-probs) or per-sample
            scalar tensors handed to the loss; padded to ``[B, L_max, ...]`` / stacked to ``[B]``. The
            :data:`LOSS_MASK_FIELD` field, when present, restricts every loss to the policy's own tokens.
    """

    prompt: OmniPrompt
    response_ids: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.response_ids = torch.as_tensor(self.response_ids, dtype=torch.long)
        if self.response_ids.ndim != 1 or self.response_ids.numel() == 0:
            raise ValueError("TrainSample.response_ids must be a non-empty 1-D sequence")
        for name, value in self.fields.items():
            value = torch.as_tensor(value)
            if value.ndim >= 1 and value.shape[0] != self.response_ids.numel():
                raise ValueError(
                    f"TrainSample.fields[{name!r}] must be a scalar or have one entry per response token "
                    f"({self.response_ids.numel()}), got shape {tuple(value.shape)}"
                )
            self.fields[name] = value


@dataclass
class LossInputs:
    """What the training engine hands to a loss function for one micro-batch.

    Attributes:
        logprobs: ``[B, L]`` log-probs of the response tokens under the current policy (with grad).
        entropy: ``[B, L]`` entropy of the policy distribution at each response position (with grad).
        mask: ``[B, L]`` float, 1 on response tokens that count: not padding, not suppressed ids, and not
            environment tokens (the samples' :data:`LOSS_MASK_FIELD` is already multiplied in).
        fields: The samples' extra fields, ``[B, L]`` (zero-padded) or ``[B]``.
        values: ``[B, L]`` critic values (with grad) when the engine trains a value model, else None.
        full_kl: ``[B, L]`` exact KL(π_ref ‖ π) over the vocabulary per position, unclamped (with grad), when the
            engine holds a frozen reference (``TorchTrainConfig.full_kl``: only the full-vocabulary KL reads it),
            else None. The engine sums it chunk by chunk where the policy's logits are: no field of size V per
            token ever reaches the engine or the loss.
    """

    logprobs: torch.Tensor
    entropy: torch.Tensor
    mask: torch.Tensor
    fields: dict[str, torch.Tensor]
    values: torch.Tensor | None = None
    full_kl: torch.Tensor | None = None


@dataclass(frozen=True)
class LossResult:
    """A micro-batch loss that says how many units it averages over, so the engine combines micro-batches
    exactly: the step loss is ``Σ_m units_m · loss_m / Σ_m units_m`` (summed over every rank's micro-batches).

    This is the form to return when the number of units a micro-batch averages over is known only from its
    data, e.g. masked importance sampling removing a different number of tokens or sequences from each
    micro-batch; static weights (the engine's ``loss_weighting``) would then weigh parts wrongly.

    Attributes:
        loss: The micro-batch's scalar loss, a mean over ``units``.
        units: How many units (tokens, sequences) ``loss`` averages over; 0 when it has none (the loss then
            contributes nothing).
        metrics: Metrics to average, combined with the same weights.
    """

    loss: torch.Tensor
    units: float
    metrics: Mapping[str, float] = field(default_factory=dict)


LossFn = Callable[[LossInputs], "torch.Tensor | tuple[torch.Tensor, Mapping[str, float]] | LossResult"]
"""Returns the micro-batch loss and optionally metrics to average: a scalar or ``(scalar, metrics)`` is
weighted as the engine's ``loss_weighting`` says; a :class:`LossResult` by its own ``units``. All micro-batches of
a step must return the same form."""


@runtime_checkable
class TrainEngine(Protocol):
    """Owns the policy's trainable state and applies one policy update (one version) per :meth:`step`."""

    @property
    def version(self) -> int:
        """Policy updates applied so far."""
        ...

    def step(self, batch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        """One policy update over ``batch`` (one or more optimizer steps over micro-batches); returns metrics."""
        ...

    def compute_logprobs(self, batch: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(logprobs [B, L], mask [B, L])`` under the current weights, without grad."""
        ...

    def compute_scores(self, batch: Sequence[TrainSample]) -> TokenScores:
        """Per-token log-probs, entropy and mask under the current weights, without grad, on CPU (what the
        Reference service writes)."""
        ...

    def policy_state(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The model weights on the CPU, for publishing: copies, or with ``copy=False`` possibly views of the live
        weights (for a caller that copies them before the next update, as every weight store's ``publish`` does:
        one copy fewer of the model per version)."""
        ...

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """Model, optimizer, scheduler, RNG and version, for checkpoints: copies, or with ``copy=False`` possibly
        views of the live state (for a caller that writes it before the next update, as a checkpoint taken while
        the Trainer is paused does: no second copy of the weights and the optimizer's moments)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores what :meth:`state_dict` returned."""
        ...

    def shutdown(self) -> None:
        """Releases what the engine holds outside the calling process (a Trainer group's rank actors) when the
        Trainer service stops; an in-process engine has nothing to release."""
        ...


class RankOptions(Protocol):
    """Where each rank of a training engine's group goes (a GPU run's placement, see
    :class:`relax_services.hosting.placement.RankPlacement`)."""

    def options(self, rank: int) -> dict[str, object]:
        """Ray actor options of rank ``rank``: its GPUs and its placement-group bundle."""
        ...

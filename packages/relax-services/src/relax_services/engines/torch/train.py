"""Built-in training engine: plain torch AdamW over a transformers model, with micro-batch accumulation."""

from __future__ import annotations

import copy as _copy
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from relax_services._malloc import release_free_memory
from relax_services.engines._threads import DEFAULT_INTRA_OP_THREADS, check_threads, pin_intra_op_threads
from relax_services.engines.micro_batches import (
    padded_response_slots,
    split_micro_batches,
    token_budget_micro_batches,
)
from relax_services.engines.progress import tick
from relax_services.engines.protocols import LOSS_MASK_FIELD, LossFn, LossInputs, LossResult, TrainSample
from relax_services.engines.scoring import (
    SCORING_CHUNK_TOKENS,
    FrozenReference,
    TokenScores,
    check_packing,
    score_responses,
    score_values,
)
from relax_services.models.lora import adapter_state, apply_lora, load_adapter_state, merged_state
from relax_services.models.value import ValueModel

if TYPE_CHECKING:
    from relax_services.config import LoraConfig

LossWeighting = Literal["tokens", "samples"]

ENGINE_METRICS = ("loss", "entropy", "tokens", "padding_frac")
"""Metrics the engine computes itself; a loss function's own values under these names are not added in (its
``entropy`` summed into the engine's token sum logged H · (1 + 1/tokens), above the entropy's maximum)."""


@dataclass(frozen=True)
class TorchTrainConfig:
    """Settings of :class:`TorchTrainEngine`.

    Attributes:
        lr: Peak learning rate.
        betas: AdamW betas.
        eps: AdamW epsilon.
        weight_decay: AdamW decoupled weight decay.
        grad_clip: Clip the global gradient norm to this; ``0`` disables clipping.
        micro_batch_size: Samples per forward/backward; gradients accumulate over the micro-batches of a step.
        max_tokens_per_micro_batch: Cut micro-batches by prompt + response tokens instead, at most this many each
            (:func:`~relax_services.engines.micro_batches.token_budget_micro_batches`; a longer sample forms one
            of its own); None: by ``micro_batch_size`` samples.
        packing: Run each micro-batch's responses packed into one row, without padding (each token attends to its
            own prompt's cached keys and its own response only; sdpa and eager attention); False: right-padded
            to the micro-batch's longest response.
        minibatches: Optimizer steps one :meth:`~TorchTrainEngine.step` (one policy update, one version) takes
            over consecutive equal slices of its batch (PPO minibatches; 1: one step on the whole batch).
        epochs: Passes over the minibatches per update (PPO epochs).
        loss_weighting: How micro-batch losses combine into the step loss. ``"tokens"``: weight by unmasked
            tokens, exact for a loss that is a token mean over its micro-batch; ``"samples"``: weight by
            samples, exact for a mean over samples. Either way accumulation equals one big batch.
        warmup_steps: Linear warm-up from ``lr / warmup_steps`` to ``lr`` over this many steps.
        schedule: After warm-up, ``"constant"``, or ``"cosine"`` / ``"linear"`` decay to ``min_lr_ratio * lr``
            at ``total_steps`` (held there afterwards).
        total_steps: Steps of the decaying schedules (required for ``"cosine"`` and ``"linear"``).
        min_lr_ratio: Floor of the decaying schedules as a fraction of ``lr``.
        temperature: Sampling temperature of the responses; log-probs use ``logits / temperature``.
        suppressed_ids: Ids outside the policy's support (never sampled); masked out of the loss.
        full_kl: Hold a frozen reference policy (:class:`~relax_services.engines.scoring.FrozenReference`) and
            hand the loss the exact per-token KL(π_ref ‖ π) over the vocabulary (``LossInputs.full_kl``) in
            training steps, summed ``scoring_chunk_tokens`` tokens at a time where the policy's logits are
            (:func:`~relax_services.engines.scoring.token_scores_with_kl`); :func:`train_config` sets it from
            ``algorithm.uses_full_kl``. Scoring never holds a ``[B, L, V]`` tensor either way.
        reference_dtype: Weight dtype of the frozen reference with ``full_kl`` (the Reference service's,
            ``dtype_of(cfg, "reference")``: bfloat16 on CUDA by default); None keeps the model's own.
        scoring_chunk_tokens: Response tokens per LM-head chunk when scoring
            (:data:`~relax_services.engines.scoring.SCORING_CHUNK_TOKENS`).
        autocast: ``"auto"`` uses bf16 autocast on a CUDA device that supports it, never on CPU;
            ``"bf16"`` forces it; ``"off"`` disables it.
        device: Torch device of the model.
        param_dtype: Dtype the model's weights are cast to (``"float32"`` for an engine that trains; a scoring-only
            engine, the Reference's, may hold ``"bfloat16"``); None keeps the model's own.
        seed: Seeds torch's global RNG when the engine is built (the model has no dropout by default;
            this keeps any stochastic layer reproducible).
        intra_op_threads: Torch intra-op threads the engine computes with, set on the process at every
            update and scoring call (None: the process's own setting). CPU reductions are split per thread, so
            the same update gives other bits at another count: a fixed count is what makes two processes (the
            Trainer service, a synchronous reference loop) compute identical weights.
        activation_checkpointing: Recompute each text decoder block (attention and MLP) in the backward pass,
            keeping only its input (torch's composable ``checkpoint``, :func:`checkpoint_blocks`): one more forward
            of the decoder per micro-batch, the same numbers.
        lora: Train low-rank adapters injected into the model (:func:`~relax_services.models.lora.apply_lora`,
            drawn after seeding) instead of every weight: the optimizer holds the adapters only,
            :meth:`~TorchTrainEngine.policy_state` gives the merged weights under the plain model's names and the
            checkpoint state holds the adapters. None: full fine-tuning.
    """

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_size: int = 64
    max_tokens_per_micro_batch: int | None = None
    packing: bool = False
    activation_checkpointing: bool = False
    minibatches: int = 1
    epochs: int = 1
    loss_weighting: LossWeighting = "tokens"
    warmup_steps: int = 0
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    temperature: float = 1.0
    suppressed_ids: tuple[int, ...] = ()
    full_kl: bool = False
    reference_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    scoring_chunk_tokens: int = SCORING_CHUNK_TOKENS
    autocast: Literal["auto", "bf16", "off"] = "auto"
    device: str = "cpu"
    param_dtype: Literal["float32", "bfloat16", "float16"] | None = None
    seed: int = 0
    intra_op_threads: int | None = DEFAULT_INTRA_OP_THREADS
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        check_threads("TorchTrainConfig", self.intra_op_threads)
        for name in ("param_dtype", "reference_dtype"):
            if getattr(self, name) not in (None, "float32", "bfloat16", "float16"):
                raise ValueError(
                    f"TorchTrainConfig.{name} must be 'float32', 'bfloat16' or 'float16', got {getattr(self, name)!r}"
                )
        if self.lr <= 0:
            raise ValueError(f"TorchTrainConfig.lr must be > 0, got {self.lr}")
        if self.micro_batch_size < 1:
            raise ValueError(f"TorchTrainConfig.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and budget < 1:
            raise ValueError(f"TorchTrainConfig.max_tokens_per_micro_batch must be >= 1 or None, got {budget}")
        if self.scoring_chunk_tokens < 1:
            raise ValueError(f"TorchTrainConfig.scoring_chunk_tokens must be >= 1, got {self.scoring_chunk_tokens}")
        if self.minibatches < 1 or self.epochs < 1:
            raise ValueError(
                f"TorchTrainConfig.minibatches and epochs must be >= 1, got {self.minibatches} and {self.epochs}"
            )
        if self.loss_weighting not in ("tokens", "samples"):
            raise ValueError(
                f"TorchTrainConfig.loss_weighting must be 'tokens' or 'samples', got {self.loss_weighting!r}"
            )
        if self.schedule not in ("constant", "cosine", "linear"):
            raise ValueError(
                f"TorchTrainConfig.schedule must be 'constant', 'cosine' or 'linear', got {self.schedule!r}"
            )
        if self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(f"TorchTrainConfig.total_steps must exceed warmup_steps for the {self.schedule} schedule")
        if self.autocast not in ("auto", "bf16", "off"):
            raise ValueError(f"TorchTrainConfig.autocast must be 'auto', 'bf16' or 'off', got {self.autocast!r}")
        if self.grad_clip < 0 or self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError("TorchTrainConfig.grad_clip, warmup_steps >= 0 and min_lr_ratio in [0, 1] required")

    def micro_batches(self, batch: Sequence[TrainSample], count: int | None = None) -> list[Sequence[TrainSample]]:
        """``batch`` cut into micro-batches: ``micro_batch_size`` samples each, or ``max_tokens_per_micro_batch``
        tokens each when set (``count``: cut into that many, for ranks that must run as many forwards)."""
        if self.max_tokens_per_micro_batch is None:
            return split_micro_batches(batch, self.micro_batch_size)
        return token_budget_micro_batches(batch, self.max_tokens_per_micro_batch, count)

    @property
    def optimizer_steps_per_update(self) -> int:
        """Optimizer steps one policy update takes (``epochs × minibatches``)."""
        return self.epochs * self.minibatches

    def lr_factor(self, step: int) -> float:
        """Multiplier of ``lr`` at policy update ``step`` (0-based)."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        decay = 1 - progress if self.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * decay


class TorchTrainEngine:
    """:class:`~relax_services.engines.TrainEngine` in plain torch.

    Args:
        model: The policy to train (moved to ``config.device`` in ``config.param_dtype``).
        config: Optimizer and loss settings.
        reference: With ``config.full_kl``, the frozen reference policy: the initial checkpoint, loaded as the
            Reference service loads it (:func:`~relax_services.engines.torch.build_train_engine` passes it); None
            takes a copy of ``model`` as handed in (its initial weights). Held in ``config.reference_dtype`` on the
            engine's device, in eval mode, without grad.

    Raises:
        ValueError: If ``reference`` is given without ``config.full_kl``.
    """

    def __init__(
        self, model: torch.nn.Module, config: TorchTrainConfig | None = None, reference: torch.nn.Module | None = None
    ) -> None:
        self.config = config or TorchTrainConfig()
        torch.manual_seed(self.config.seed)
        self.device = torch.device(self.config.device)
        self.reference = frozen_reference(self.config, self.device, model, reference)
        dtype = None if self.config.param_dtype is None else getattr(torch, self.config.param_dtype)
        if self.config.lora is not None:
            model = apply_lora(model, self.config.lora)
        self.model = model.to(self.device, dtype)
        if self.config.activation_checkpointing:
            checkpoint_blocks(self.model)
        if self.config.packing:
            check_packing(self.model.thinker if isinstance(self.model, ValueModel) else self.model)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.config.lr_factor)
        self._version = 0

    @property
    def version(self) -> int:
        """Policy updates (:meth:`step` calls) applied so far."""
        return self._version

    @property
    def autocast_enabled(self) -> bool:
        """Whether forwards run under bf16 autocast."""
        return autocast_enabled(self.config, self.device)

    def _autocast(self) -> AbstractContextManager[object]:
        return autocast_context(self.config, self.device)

    def score(self, batch: Sequence[TrainSample], full_kl: bool = False) -> TokenScores:
        """Forward over one micro-batch: response log-probs, entropy, mask and (``full_kl``, with the frozen
        reference) the per-token full KL (grad follows the caller)."""
        with self._autocast():
            return score_responses(
                self.model,
                [s.prompt for s in batch],
                [s.response_ids for s in batch],
                temperature=self.config.temperature,
                suppressed_ids=self.config.suppressed_ids,
                device=self.device,
                reference=self.reference if full_kl else None,
                chunk_tokens=self.config.scoring_chunk_tokens,
                packed=self.config.packing,
            )

    def compute_logprobs(self, batch: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(logprobs [B, L], mask [B, L])`` on CPU under the current weights, without grad."""
        scores = self._score_without_grad(batch)
        return scores.logprobs, scores.mask

    def compute_scores(self, batch: Sequence[TrainSample]) -> TokenScores:
        """:class:`TokenScores` (log-probs, entropy, mask) on CPU under the current weights, without grad."""
        return self._score_without_grad(batch)

    def _score_without_grad(self, batch: Sequence[TrainSample]) -> TokenScores:
        """:meth:`score` over every micro-batch in eval mode without grad, joined on CPU (padded to the longest)."""
        pin_intra_op_threads(self.config.intra_op_threads)
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            parts = [self.score(micro) for micro in self.config.micro_batches(batch)]
        self.model.train(was_training)
        length = max(p.mask.shape[1] for p in parts)

        def join(tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat([_pad_to(x, length) for x in tensors]).cpu()

        values = [p.values for p in parts if p.values is not None]
        return TokenScores(
            logprobs=join([p.logprobs for p in parts]),
            entropy=join([p.entropy for p in parts]),
            mask=join([p.mask for p in parts]),
            values=join(values).float() if values else None,
        )

    def accumulate_gradients(self, batch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        """Adds the gradient of the batch loss to ``.grad`` (no optimizer step); returns loss metrics.

        The batch loss is ``Σ_m w_m · loss_fn(micro-batch m)`` with ``w_m`` the micro-batch's share of
        unmasked tokens (or samples, per ``loss_weighting``), or its share of the units the loss reports when
        ``loss_fn`` returns :class:`LossResult`. ``LossInputs.full_kl`` is set only with ``config.full_kl``.
        """
        if not batch:
            raise ValueError("cannot train on an empty batch")
        pin_intra_op_threads(self.config.intra_op_threads)
        self.model.train()
        micro_batches = self.config.micro_batches(batch)
        weights = self._weights(micro_batches)
        totals: dict[str, float] = {"loss": 0.0, "entropy": 0.0, "tokens": 0.0}
        units = [
            backward_micro_batch(loss_fn, micro, self.score(micro, self.config.full_kl), weight, totals)
            for micro, weight in zip(micro_batches, weights, strict=True)
        ]
        local_units = units_of_step(units)
        if local_units is not None:
            rescale_by_units(self.model.parameters(), totals, local_units)
        totals["entropy"] /= max(totals["tokens"], 1.0)
        run, real = padded_response_slots(micro_batches, self.config.packing)
        totals["padding_frac"] = (run - real) / real
        return totals

    def step(self, batch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        """One policy update (one version): ``epochs × minibatches`` optimizer steps, each accumulating over
        micro-batches, clipping and stepping AdamW; then one LR schedule step.

        The batch is cut into ``minibatches`` consecutive slices of equal size (callers keep groups whole by
        passing a batch whose size is a multiple of ``minibatches × group size``).

        Returns:
            Metrics: ``loss``, ``entropy``, ``tokens``, ``grad_norm`` (before clipping), ``padding_frac`` (padding
            positions the response forwards ran per real response token; 0 with ``packing``) and ``loss_fn``'s own
            metrics, averaged over the optimizer steps; ``lr`` (used by this update), ``step_s``, ``version``
            (after the update).
        """
        if len(batch) % self.config.minibatches:
            raise ValueError(
                f"a batch of {len(batch)} samples does not split into {self.config.minibatches} equal minibatches"
            )
        start = time.perf_counter()
        size = len(batch) // self.config.minibatches
        lr = float(self.optimizer.param_groups[0]["lr"])
        totals: dict[str, float] = {}
        for _ in range(self.config.epochs):
            for first in range(0, len(batch), size):
                for key, value in self._optimizer_step(batch[first : first + size], loss_fn).items():
                    totals[key] = totals.get(key, 0.0) + value
        metrics = {k: v / self.config.optimizer_steps_per_update for k, v in totals.items()}
        release_update_memory(self.optimizer)
        self.scheduler.step()
        self._version += 1
        metrics.update(lr=lr, step_s=time.perf_counter() - start, version=float(self._version))
        return metrics

    def _optimizer_step(self, batch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        metrics = self.accumulate_gradients(batch, loss_fn)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        metrics["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        return metrics

    def policy_state(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The weights on the CPU: detached copies (safe to publish while training continues), or with
        ``copy=False`` detached views of the live weights where they are on the CPU; with ``config.lora`` the
        adapters merged in, under the plain model's names (:func:`~relax_services.models.lora.merged_state`, new
        tensors either way)."""
        if self.config.lora is not None:
            return merged_state(self.model)
        return {k: v.detach().to("cpu", copy=copy) for k, v in self.model.state_dict().items()}

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """With ``config.lora``: CPU copies of the adapters alone under the adapted model's names
        (:func:`~relax_services.models.lora.adapter_state`), what the Trainer publishes for LoRA requests
        (``rollout.vllm.lora_requests``).

        Raises:
            ValueError: The engine trains every weight (``config.lora`` is None).
        """
        if self.config.lora is None:
            raise ValueError("TorchTrainEngine.adapter_state: the engine trains every weight (config.lora is None)")
        return adapter_state(self.model)

    def state_dict(self, *, copy: bool = True) -> dict[str, Any]:
        """Model, optimizer, scheduler, torch RNG states and version: copies, or with ``copy=False`` views of the
        live weights and moments (to be written before the next update). With ``config.lora`` the model entry is
        the adapters alone (the frozen weights are the checkpoint folder's)."""
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        optimizer = self.optimizer.state_dict()
        return {
            "model": self.policy_state(copy=copy) if self.config.lora is None else adapter_state(self.model),
            # The optimizer's state dict holds its live moment tensors, which later steps update in place.
            "optimizer": _copy.deepcopy(optimizer) if copy else optimizer,
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
            "version": self._version,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict`."""
        if self.config.lora is None:
            self.model.load_state_dict(state["model"], strict=True)
        else:
            load_adapter_state(self.model, state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self._version = int(state["version"])

    def shutdown(self) -> None:
        """Nothing to release: the model and optimizer live in this process and go with it."""

    def _weights(self, micro_batches: list[Sequence[TrainSample]]) -> list[float]:
        if self.config.loss_weighting == "samples":
            counts = [float(len(m)) for m in micro_batches]
        else:
            banned = torch.tensor(sorted(self.config.suppressed_ids), dtype=torch.long)
            counts = [sum(trained_tokens(s, banned) for s in m) for m in micro_batches]
        total = sum(counts)
        if total == 0:
            raise ValueError("batch has no unmasked response tokens to train on")
        return [c / total for c in counts]


class TorchValueEngine(TorchTrainEngine):
    """Trains a critic (:class:`~relax_services.models.ValueModel`): the loss function reads ``inputs.values``.

    Same optimizer, accumulation, minibatches and checkpoint state as :class:`TorchTrainEngine`.
    """

    model: ValueModel

    def score(self, batch: Sequence[TrainSample], full_kl: bool = False) -> TokenScores:
        """Per-token values ``[B, L]`` (with grad) in place of the policy's log-probs, for the value loss (a critic
        has no distribution: ``full_kl`` is ignored)."""
        with self._autocast():
            return score_values(
                self.model,
                [s.prompt for s in batch],
                [s.response_ids for s in batch],
                suppressed_ids=self.config.suppressed_ids,
                device=self.device,
                packed=self.config.packing,
            )

    def compute_values(self, batch: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(values [B, L], mask [B, L])`` on CPU under the current critic, without grad."""
        scores = self._score_without_grad(batch)
        assert scores.values is not None, "score_values sets values"
        return scores.values, scores.mask


def frozen_reference(
    config: TorchTrainConfig, device: torch.device, model: torch.nn.Module, reference: torch.nn.Module | None
) -> FrozenReference | None:
    """The frozen reference an engine with ``config`` holds: ``reference`` (or a copy of ``model``, the policy's
    initial weights, when None) in ``config.reference_dtype`` on ``device`` with ``config.full_kl``, else None.

    Raises:
        ValueError: If ``reference`` is given without ``config.full_kl``.
    """
    if not config.full_kl:
        if reference is not None:
            raise ValueError("a reference model is only held for the full-vocabulary KL (TorchTrainConfig.full_kl)")
        return None
    dtype = None if config.reference_dtype is None else getattr(torch, config.reference_dtype)
    return FrozenReference(reference if reference is not None else _copy.deepcopy(model), device, dtype)


def release_update_memory(optimizer: torch.optim.Optimizer) -> None:
    """The end of an update: its gradients are dropped (the next update starts from zero; kept, they would hold a
    model's worth of memory while the process publishes, checkpoints or, colocated, generates) and the C heap's
    free pages go back to the system."""
    optimizer.zero_grad(set_to_none=True)
    release_free_memory()


def autocast_enabled(config: TorchTrainConfig, device: torch.device) -> bool:
    """Whether an engine with ``config`` on ``device`` runs its forwards under bf16 autocast."""
    if config.autocast == "off":
        return False
    if config.autocast == "bf16":
        return True
    return device.type == "cuda" and torch.cuda.is_bf16_supported()


def autocast_context(config: TorchTrainConfig, device: torch.device) -> AbstractContextManager[object]:
    """bf16 autocast when :func:`autocast_enabled`, else a no-op context."""
    if not autocast_enabled(config, device):
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def backward_micro_batch(
    loss_fn: LossFn, micro: Sequence[TrainSample], scores: TokenScores, weight: float, totals: dict[str, float]
) -> float | None:
    """Runs ``loss_fn`` on one micro-batch's scores, back-propagates its weighted loss and adds its metrics into
    ``totals``: ``loss`` and the loss function's own metrics weighted, ``entropy`` (a token sum) and ``tokens``.

    The weight is ``weight`` for a plain loss; for a :class:`LossResult` it is the result's ``units``, and the
    caller divides gradients and weighted metrics by the step's total units afterwards
    (:func:`rescale_by_units`) — the total is known only once every micro-batch (of every rank) has run.

    Returns:
        The result's ``units`` for a :class:`LossResult`, else None.

    Raises:
        ValueError: If ``loss_fn`` does not return a scalar, or reports negative units.
    """
    fields = _stack_fields(micro, scores.mask)
    mask = scores.mask  # [B, L]
    if LOSS_MASK_FIELD in fields:  # environment tokens are context only: out of the loss and the token metrics
        mask = mask * fields[LOSS_MASK_FIELD].to(mask.dtype)
    inputs = LossInputs(scores.logprobs, scores.entropy, mask, fields, scores.values, scores.full_kl)
    result = loss_fn(inputs)
    loss: torch.Tensor
    extra: Mapping[str, float]
    units: float | None = None
    if isinstance(result, LossResult):
        loss, extra, units = result.loss, result.metrics, float(result.units)
        if units < 0:
            raise ValueError(f"loss_fn reported {units} units; a loss averages over zero or more")
        weight = units
    else:
        loss, extra = (result, {}) if isinstance(result, torch.Tensor) else result
    if loss.ndim != 0:
        raise ValueError(f"loss_fn must return a scalar, got shape {tuple(loss.shape)}")
    torch.autograd.backward(loss * weight)
    tick()  # a micro-batch done: progress for the service that runs this update
    totals["loss"] += weight * float(loss.detach())
    totals["entropy"] += float((scores.entropy.detach() * mask).sum())
    totals["tokens"] += float(mask.sum())
    for key, value in extra.items():
        if key not in ENGINE_METRICS:  # the engine measures these itself
            totals[key] = totals.get(key, 0.0) + weight * float(value)
    return units


def trained_tokens(sample: TrainSample, banned: torch.Tensor) -> float:
    """How many of ``sample``'s response tokens a loss trains on: not a ``banned`` (suppressed) id, and a policy
    token by its :data:`~relax_services.engines.protocols.LOSS_MASK_FIELD` when it has one."""
    kept = ~torch.isin(sample.response_ids, banned)  # [L]
    if LOSS_MASK_FIELD in sample.fields:
        kept = kept & sample.fields[LOSS_MASK_FIELD].bool()
    return float(kept.sum())


def units_of_step(units: Sequence[float | None]) -> float | None:
    """The sum of the micro-batches' units when the loss returned :class:`LossResult`, else None.

    Raises:
        ValueError: If some micro-batches returned a :class:`LossResult` and others a plain loss.
    """
    given = [u for u in units if u is not None]
    if not given:
        return None
    if len(given) != len(units):
        raise ValueError("loss_fn returned a LossResult for some micro-batches and a plain loss for others")
    return float(sum(given))


def rescale_by_units(parameters: Iterable[torch.nn.Parameter], totals: dict[str, float], units: float) -> None:
    """Turns the unit-weighted sums of :func:`backward_micro_batch` into means over the step's ``units``: divides
    every gradient and every weighted metric (all but the ``entropy`` and ``tokens`` sums) by ``units``.

    With no units at all (masked IS rejected every token) every loss was weighted by 0: gradients stay zero.
    """
    scale = 1.0 / units if units > 0 else 0.0
    with torch.no_grad():
        for p in parameters:
            if p.grad is not None:
                p.grad.mul_(scale)
    for key in totals:
        if key not in ("entropy", "tokens"):
            totals[key] *= scale


def _pad_to(x: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, L, ...]`` zero-padded along dim 1 to ``length``."""
    out = x.new_zeros((x.shape[0], length, *x.shape[2:]))
    out[:, : x.shape[1]] = x
    return out


def _stack_fields(batch: Sequence[TrainSample], mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-token fields (``[L_i, ...]``) zero-padded to ``[B, L, ...]`` and scalar fields stacked to ``[B]``, on
    ``mask``'s device."""
    names = set(batch[0].fields)
    for s in batch:
        if set(s.fields) != names:
            raise ValueError(f"samples in a batch must have the same fields: {sorted(names)} vs {sorted(s.fields)}")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        values = [s.fields[name] for s in batch]
        if values[0].ndim == 0:
            out[name] = torch.stack(values).to(mask.device)
            continue
        padded = values[0].new_zeros((len(values), mask.shape[1], *values[0].shape[1:]))  # [B, L, ...]
        for i, v in enumerate(values):
            padded[i, : v.shape[0]] = v
        out[name] = padded.to(mask.device)
    return out


def checkpoint_blocks(model: torch.nn.Module) -> None:
    """Make every text decoder block of ``model`` (the policy's or a value model's,
    :func:`~relax_services.engines.fsdp.layout.decoder_blocks`) recompute its activations in the backward pass: a
    block keeps only its inputs, as the FSDP2 engine's blocks do. The prompt cache a group's rows share is a
    :class:`~relax_services.engines.scoring.ReplayableCache`, so a block's second forward attends to the same keys.

    Raises:
        ValueError: If ``model`` has no decoder blocks by those names.
    """
    from torch.distributed._composable.checkpoint_activation import checkpoint

    from relax_services.engines.fsdp.layout import decoder_blocks

    for block in decoder_blocks(model):
        checkpoint(block)

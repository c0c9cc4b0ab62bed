"""Built-in rollout engine: batched incremental decoding of a transformers model of any supported family.

Each prompt is prefilled once with its media, its KV cache is then gathered to the ``n`` rows of its
group (prompt sharing), and all rows decode in lock step, one forward per token; finished rows are
dropped from the cache as they end.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch

from relax_services._malloc import release_free_memory
from relax_services.engines._threads import DEFAULT_INTRA_OP_THREADS, check_threads, pin_intra_op_threads
from relax_services.engines.progress import tick
from relax_services.engines.protocols import (
    PARTIAL_ROLLOUT_MODES,
    Completion,
    PartialRolloutMode,
    WeightPoll,
    generation_stats,
)
from relax_services.engines.sampling import SamplingParams, sample_tokens
from relax_services.models.deepstack import text_decoder
from relax_services.models.embeddings import decoder_inputs
from relax_services.models.families import family_of_model
from relax_services.models.inputs import OmniPrompt, collate_media, pad_sequences
from relax_services.models.modalities import MODEL_MODALITIES
from relax_services.models.positions import forward_media, position_ids_for, sequence_positions
from relax_services.models.tokens import model_pad_id


@dataclass(frozen=True)
class HFRolloutConfig:
    """Settings of :class:`HFRolloutEngine`.

    Attributes:
        partial_rollout: What happens to generation in flight when newer weights arrive:
            ``"finish_old"``: weights are polled only at the start of :meth:`~HFRolloutEngine.generate`, so
            every call finishes on the weights it started with;
            ``"switch"``: newer weights are loaded between decode steps, the KV cache of prompt and tokens
            generated so far is recomputed under them (prompt prefilled once per group, then the generated
            tokens in one chunk), and later tokens are tagged with the new version;
            ``"abort_resume"``: unfinished completions are discarded and restarted from the prompt on the
            new weights (finished ones are kept).
        share_prompt: Prefill each prompt once for its group; ``False`` prefills each of the ``n`` rows
            separately (same samples, for comparisons).
        poll_every: Poll for weights every this many decode steps (``switch`` and ``abort_resume``).
        seed: Seed of the engine's sampling RNG.
        device: Torch device of the model.
        dtype: Dtype the model's weights are cast to (``"bfloat16"`` halves a GPU's weight memory; behaviour
            log-probs are then bfloat16's, which the trainer's decoupled/importance-weighted losses correct); None
            keeps the model's own.
        intra_op_threads: Torch intra-op threads generation computes with, set on the process at every
            :meth:`~HFRolloutEngine.generate` call (None: the process's own setting); a fixed count gives the
            same behaviour log-probs in every process (see ``relax_services.engines._threads``).
    """

    partial_rollout: PartialRolloutMode = "finish_old"
    share_prompt: bool = True
    poll_every: int = 1
    seed: int = 0
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    intra_op_threads: int | None = DEFAULT_INTRA_OP_THREADS

    def __post_init__(self) -> None:
        check_threads("HFRolloutConfig", self.intra_op_threads)
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"HFRolloutConfig.dtype must be 'float32', 'bfloat16' or 'float16', got {self.dtype!r}")
        if self.partial_rollout not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(
                f"HFRolloutConfig.partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, got {self.partial_rollout!r}"
            )
        if self.poll_every < 1:
            raise ValueError(f"HFRolloutConfig.poll_every must be >= 1, got {self.poll_every}")


@dataclass
class _DecodeState:
    """Decoding state of the active rows (all rows have generated the same number of tokens)."""

    slots: torch.Tensor  # [R] output slot of each row (prompt index * n + sample index)
    cache: Any  # transformers Cache over the R rows
    attention_mask: torch.Tensor  # [R, S] 1 on real prompt/response tokens
    next_pos: torch.Tensor  # [R] rope position of the next token fed
    logits: torch.Tensor  # [R, V] next-token logits

    def select(self, keep: torch.Tensor) -> None:
        """Keeps rows ``keep`` ([R'] indices)."""
        self.slots = self.slots[keep]
        self.cache.batch_select_indices(keep)
        self.attention_mask = self.attention_mask[keep]
        self.next_pos = self.next_pos[keep]
        self.logits = self.logits[keep]


class HFRolloutEngine:
    """:class:`~relax_services.engines.RolloutEngine` over a transformers Qwen2.5-Omni thinker.

    Args:
        model: The policy; put in eval mode and moved to ``config.device``.
        config: Engine settings.
        version: Policy version of the initial weights.
    """

    def __init__(self, model: torch.nn.Module, config: HFRolloutConfig | None = None, version: int = 0) -> None:
        self.config = config or HFRolloutConfig()
        self.device = torch.device(self.config.device)
        dtype = None if self.config.dtype is None else getattr(torch, self.config.dtype)
        self.model = model.to(self.device, dtype).eval()
        # Prefill and recomputation need the last position's logits only: families whose forward takes
        # ``logits_to_keep`` skip the LM head on the rest (a [rows, prompt, V] tensor at a real vocabulary).
        keeps = "logits_to_keep" in inspect.signature(type(self.model).forward).parameters
        self._last_logits: dict[str, int] = {"logits_to_keep": 1} if keeps else {}
        self._version = version
        self._shared = False  # the parameters are a published version's tensors (load_weights' CPU path)
        self._released = False  # release_weights dropped them: nothing to compute with until load_weights
        self.generator = torch.Generator().manual_seed(self.config.seed)
        self.last_stats: dict[str, float] = {}

    @property
    def version(self) -> int:
        """Policy version of the loaded weights."""
        return self._version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Loads ``state_dict`` (strict) and sets the version.

        On the CPU, when every tensor already has the parameter's dtype and shape, the model's parameters become
        the published tensors themselves instead of copies: a published version is one read-only copy (in the
        object store's shared memory, or the in-process store's dict) that every rollout worker and evaluator of
        the node computes with, where each held its own before. Generation never writes a weight. Elsewhere (a
        GPU, another dtype) the tensors are copied into the model's own.
        """
        if version < self._version:
            raise ValueError(f"refusing to load weights version {version} over newer version {self._version}")
        weights = dict(state_dict)
        share = self._can_share(weights)
        if self._released and not share:  # copying needs parameters of its own to copy into
            self._materialize()
        self.model.load_state_dict(weights, strict=True, assign=share)
        self._shared, self._released = share, False
        self._version = version

    def release_weights(self) -> bool:
        """Drops a published version's tensors this engine computes with (loaded by :meth:`load_weights` on the
        CPU path), so that an idle reader — an Evaluator between evaluations — keeps no version alive once the store
        has moved on (a Ray object stays in shared memory while any view of it lives). The parameters become meta
        tensors and the persistent buffers copies of their own, until the next :meth:`load_weights`; the version
        is kept. Returns whether anything was dropped (weights of the engine's own, copied in, are kept)."""
        if not self._shared:
            return False
        metas: dict[int, torch.nn.Parameter] = {}  # tied parameters stay one parameter
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None:
                    meta = metas.setdefault(id(param), torch.nn.Parameter(param.to("meta"), requires_grad=False))
                    module._parameters[name] = meta
            for name in set(module._buffers) - module._non_persistent_buffers_set:
                buffer = module._buffers[name]
                if buffer is not None:
                    module._buffers[name] = buffer.clone()
        self._shared, self._released = False, True
        return True

    def _materialize(self) -> None:
        """Uninitialised parameters of the engine's own in place of released (meta) ones, to copy weights into."""
        owned: dict[int, torch.nn.Parameter] = {}
        for module in self.model.modules():
            for name, param in list(module._parameters.items()):
                if param is not None and param.is_meta:
                    empty = torch.empty(param.shape, dtype=param.dtype, device=self.device)
                    module._parameters[name] = owned.setdefault(id(param), torch.nn.Parameter(empty, False))

    def _can_share(self, weights: Mapping[str, torch.Tensor]) -> bool:
        """Whether the model can compute with ``weights`` as they are (CPU, same names, dtypes and shapes)."""
        if self.device.type != "cpu":
            return False
        own = self.model.state_dict()
        return own.keys() == weights.keys() and all(
            t.device.type == "cpu" and t.dtype == own[k].dtype and t.shape == own[k].shape for k, t in weights.items()
        )

    def seed(self, seed: int) -> None:
        """Reseeds the sampling RNG (see :meth:`RolloutEngine.seed`)."""
        self.generator.manual_seed(seed)

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[OmniPrompt],
        params: SamplingParams,
        poll_weights: WeightPoll | None = None,
    ) -> list[list[Completion]]:
        """Samples ``params.n`` completions for each prompt; see :class:`HFRolloutConfig` for weight updates.

        Args:
            prompts: Prompts, batched together (left-padded).
            params: Sampling parameters.
            poll_weights: Returns ``(version, state_dict)`` when newer weights exist, else ``None``.

        Returns:
            ``[len(prompts)][params.n]`` completions.
        """
        if not prompts:
            return []
        pin_intra_op_threads(self.config.intra_op_threads)
        start = time.perf_counter()
        if poll_weights is not None:
            self._apply(poll_weights())
        if self._released:
            raise RuntimeError("this engine's weights were released (release_weights): load_weights before generate")
        n_slots = len(prompts) * params.n
        out = [Completion() for _ in range(n_slots)]
        state = self._prefill(prompts, torch.arange(n_slots), params.n)
        steps, forwards = 0, 1
        mode = self.config.partial_rollout
        while True:
            # One uniform per slot and step, whatever rows are still active.
            uniforms = torch.rand(n_slots, generator=self.generator)  # [n_slots]
            tokens, logp, samp_logp = sample_tokens(state.logits, params, uniforms[state.slots])
            done = self._record(out, state.slots, tokens, logp, samp_logp, params)
            steps += 1
            tick()
            if bool(done.all()):
                break
            keep = (~done).nonzero()[:, 0]
            tokens = tokens[keep]
            if len(keep) < len(done):
                state.select(keep)
            if poll_weights is not None and mode != "finish_old" and steps % self.config.poll_every == 0:
                update = poll_weights()
                if update is not None and update[0] > self._version:
                    self._apply(update)
                    forwards += 1
                    if mode == "switch":
                        state = self._recompute(prompts, out, state, params.n)
                    else:
                        for slot in state.slots.tolist():
                            restarts = out[slot].num_restarts + 1
                            out[slot] = Completion(num_restarts=restarts)
                        state = self._prefill(prompts, state.slots, params.n)
                    continue
            self._decode_step(state, tokens)
            forwards += 1
        self.last_stats = generation_stats(out, time.perf_counter() - start, decode_steps=steps, forwards=forwards)
        del state
        release_free_memory()  # the call's key/value caches, freed into the C heap
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _apply(self, update: tuple[int, Mapping[str, torch.Tensor]] | None) -> None:
        if update is not None and update[0] > self._version:
            self.load_weights(update[1], update[0])

    def _record(
        self,
        out: list[Completion],
        slots: torch.Tensor,
        tokens: torch.Tensor,
        logp: torch.Tensor,
        samp_logp: torch.Tensor,
        params: SamplingParams,
    ) -> torch.Tensor:
        """Appends each row's token to its completion; returns ``[R]`` bool: the row finished."""
        done = torch.zeros(len(slots), dtype=torch.bool)
        for row, (slot, tok, lp, slp) in enumerate(
            zip(slots.tolist(), tokens.tolist(), logp.tolist(), samp_logp.tolist(), strict=True)
        ):
            c = out[slot]
            c.token_ids.append(tok)
            c.logprobs.append(lp)
            c.sampling_logprobs.append(slp)
            c.versions.append(self._version)
            if tok == params.eos_id:
                c.finish_reason = "stop"
                done[row] = True
            elif len(c.token_ids) >= params.max_new_tokens:
                c.finish_reason = "length"
                done[row] = True
        return done

    def _prefill(self, prompts: Sequence[OmniPrompt], slots: torch.Tensor, n: int) -> _DecodeState:
        """Prefills the prompts of ``slots`` ([R]) and gathers each prompt's cache to its rows."""
        prompt_of_row = slots // n  # [R]
        if self.config.share_prompt:
            unique, row_to_unique = torch.unique(prompt_of_row, sorted=True, return_inverse=True)
        else:
            unique, row_to_unique = prompt_of_row, torch.arange(len(slots))
        batch = [prompts[i] for i in unique.tolist()]
        input_ids, attention_mask = pad_sequences([p.input_ids for p in batch], model_pad_id(self.model), side="left")
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        positions, next_pos = sequence_positions(self.model, batch, [0] * len(batch), side="left")  # [3, U, T], [U]
        positions, next_pos = positions.to(self.device), next_pos.to(self.device)
        common = {"attention_mask": attention_mask, "position_ids": position_ids_for(self.model, positions)}
        if _has_foreign_media(self.model, batch):
            # A registered modality the model's own forward does not take: its encoder call is the modality's,
            # so the prompts go into the text decoder as embeddings (each distinct item encoded once, with a
            # DeepStack family's inner-layer vision features), and its last states through the LM head.
            inputs = decoder_inputs(self.model, batch, input_ids, self.device)
            states = text_decoder(self.model)(**inputs, **common, use_cache=True)
            cache = states.past_key_values
            last = cast(Any, self.model).lm_head(states.last_hidden_state[:, -1])  # [U, V]
        else:
            media = {k: v.to(self.device) for k, v in forward_media(self.model, collate_media(batch)).items()}
            out = self.model(input_ids=input_ids, **media, **common, use_cache=True, **self._last_logits)
            cache, last = out.past_key_values, out.logits[:, -1]  # [U, V]
        index = row_to_unique.to(self.device)
        cache.batch_select_indices(index)
        return _DecodeState(
            slots=slots.clone(),
            cache=cache,
            attention_mask=attention_mask[index],
            next_pos=next_pos[index],  # [R]
            logits=last[index],  # [R, V]
        )

    def _decode_step(self, state: _DecodeState, tokens: torch.Tensor) -> None:
        """Feeds one token per row ([R]) and updates ``state`` in place."""
        rows = len(tokens)
        state.attention_mask = torch.cat(
            [state.attention_mask, state.attention_mask.new_ones(rows, 1)], dim=1
        )  # [R, S + 1]
        position_ids = state.next_pos.view(1, rows, 1).expand(3, rows, 1)  # [3, R, 1]
        out = self.model(
            input_ids=tokens.view(rows, 1).to(self.device),
            attention_mask=state.attention_mask,
            position_ids=position_ids_for(self.model, position_ids),
            past_key_values=state.cache,
            use_cache=True,
        )
        state.cache = out.past_key_values
        state.next_pos = state.next_pos + 1
        state.logits = out.logits[:, -1]  # [R, V]

    def _recompute(
        self, prompts: Sequence[OmniPrompt], out: list[Completion], state: _DecodeState, n: int
    ) -> _DecodeState:
        """Rebuilds the active rows' KV cache under the current weights (``switch`` mode).

        The prompts are prefilled once per group and the tokens generated so far (equal in number on every
        active row) are fed as one chunk; the returned logits predict the next token.
        """
        fresh = self._prefill(prompts, state.slots, n)
        generated = torch.tensor([out[s].token_ids for s in state.slots.tolist()], dtype=torch.long)  # [R, t]
        rows, t = generated.shape
        fresh.attention_mask = torch.cat(
            [fresh.attention_mask, fresh.attention_mask.new_ones(rows, t)], dim=1
        )  # [R, S + t]
        steps = torch.arange(t, device=self.device)
        position_ids = (fresh.next_pos[:, None] + steps[None, :]).unsqueeze(0).expand(3, rows, t)  # [3, R, t]
        res = self.model(
            input_ids=generated.to(self.device),
            attention_mask=fresh.attention_mask,
            position_ids=position_ids_for(self.model, position_ids),
            past_key_values=fresh.cache,
            use_cache=True,
            **self._last_logits,
        )
        fresh.cache = res.past_key_values
        fresh.next_pos = fresh.next_pos + t
        fresh.logits = res.logits[:, -1]  # [R, V]
        return fresh

    def rng_state(self) -> torch.Tensor:
        """State of the sampling RNG (for checkpoints)."""
        return self.generator.get_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        """Restores :meth:`rng_state`."""
        self.generator.set_state(state)


def _has_foreign_media(model: torch.nn.Module, prompts: Sequence[OmniPrompt]) -> bool:
    """Whether a prompt has media of a registered modality outside the model family's own
    (:attr:`~relax_services.models.ModelFamily.modalities`)."""
    native = family_of_model(model).modalities
    return any(m.name not in native and p.media_of(m) for m in MODEL_MODALITIES.values() for p in prompts)

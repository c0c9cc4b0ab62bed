"""Distributed training engine: the policy sharded with torch FSDP2 (``fully_shard``) over a process group.

Every rank builds the same model, receives the same batch (a batch of whole groups) and trains on its own
contiguous share of each minibatch. The micro-batch losses are weighted by their share of the *whole*
minibatch's tokens (or samples) and the gradient reduction sums instead of averaging, so the gradient of
``N`` ranks is the gradient of one process on the same batch: the engine is a drop-in
:class:`~relax_services.engines.TrainEngine` for the single-process
:class:`~relax_services.engines.TorchTrainEngine`, to float rounding (the ranks add partial sums in a
different order than one process does).

Sharding: ``fully_shard`` per text decoder block, then the root, a module whose forward is the whole scoring
computation (:mod:`~relax_services.engines.fsdp.layout`); the root group holds the embeddings, final norm, LM head
and the media encoders. The encoders stay in the root group on purpose: a rank whose share holds no image never
runs the vision tower, so a separately sharded tower would leave the other ranks waiting in its all-gather.
Parameters one rank did not use get zero gradients in the reduction (``set_reduce_scatter_unused_params``).

With sequence parallelism (``sp_mesh``) the ranks of an sp group take the same share and split every sequence of it
(:mod:`~relax_services.engines.fsdp.sequence_parallel`); FSDP then shards over ``dp × sp`` flattened, so the
reduce-scatter also sums the sequence slices' gradients.

With ``config.lora`` every rank injects the adapters before sharding (data parallelism only): the frozen weights are
sharded like any others but get no gradient and no optimizer state, the published weights are the merged ones under
the plain model's names (as the single-process engine's) and every state or checkpoint holds the adapters alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import OptimizerStateType, StateDictOptions, ValueType
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from relax_services.engines._threads import pin_intra_op_threads
from relax_services.engines.fsdp.layout import ScoringRoot, decoder_blocks, joined_mesh, shard_group
from relax_services.engines.fsdp.sequence_parallel import (
    SequenceParallel,
    check_sequence_parallel,
    enable_sequence_parallel,
)
from relax_services.engines.fsdp.state import clone_state, load_train_state, train_state, trainable_state
from relax_services.engines.fsdp.tensor_parallel import clip_gradients
from relax_services.engines.micro_batches import padded_response_slots
from relax_services.engines.protocols import LossFn, TrainSample
from relax_services.engines.scoring import TokenScores, check_packing
from relax_services.engines.torch.train import (
    TorchTrainConfig,
    _pad_to,
    autocast_context,
    autocast_enabled,
    backward_micro_batch,
    frozen_reference,
    release_update_memory,
    rescale_by_units,
    trained_tokens,
    units_of_step,
)
from relax_services.models.lora import apply_lora, merge_adapters
from relax_services.models.value import ValueModel

__all__ = [
    "FSDPConfig",
    "FSDPTrainEngine",
    "FSDPValueEngine",
    "decoder_blocks",
    "load_train_state",
    "shard_group",
    "train_state",
]


@dataclass(frozen=True)
class FSDPConfig:
    """How :class:`FSDPTrainEngine` shards the model; optimizer and loss settings stay in
    :class:`~relax_services.engines.TorchTrainConfig`.

    Attributes:
        mixed_precision: ``"auto"``: bf16 parameters for compute with fp32 gradient reduction on CUDA, full
            fp32 on CPU; ``"bf16"`` forces that policy; ``"off"`` computes and reduces in the parameters'
            dtype. The sharded master weights and the optimizer state stay fp32 either way.
        activation_checkpointing: Recompute each decoder block (attention and MLP) in backward, keeping only its
            input (the prompt cache the rows share is a :class:`~relax_services.engines.scoring.ReplayableCache`,
            which a second forward reads as the first did).
        reshard_after_forward: Free each block's gathered parameters after its forward and gather again in
            backward (ZeRO-3, least memory); ``False`` keeps them until backward (ZeRO-2, less traffic).
        cpu_offload: Keep the parameter shards, their gradients and the optimizer state in host memory, copied to
            the device for each block's compute (FSDP2's ``CPUOffloadPolicy``; the optimizer steps on the CPU). On
            a CPU device it changes nothing.
    """

    mixed_precision: Literal["auto", "bf16", "off"] = "auto"
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.mixed_precision not in ("auto", "bf16", "off"):
            raise ValueError(
                f"FSDPConfig.mixed_precision must be 'auto', 'bf16' or 'off', got {self.mixed_precision!r}"
            )


FSDP2_METHODS: tuple[str, ...] = (
    "set_gradient_divide_factor",
    "set_force_sum_reduction_for_comms",
    "set_reduce_scatter_unused_params",
)
"""The ``FSDPModule`` methods the engine calls (exact gradient sums over gloo and NCCL, parameters unused by a
rank's batch reduced all the same); recent FSDP2 additions, checked when an engine is built (torch 2.14 is the
version tested)."""


def fsdp2_lacks() -> str | None:
    """Why the installed torch cannot run the engine (its FSDP2 lacks a method of :data:`FSDP2_METHODS`), or None."""
    missing = [name for name in FSDP2_METHODS if not hasattr(FSDPModule, name)]
    if not missing:
        return None
    return (
        f"trainer.engine='fsdp' needs torch's FSDP2 with FSDPModule.{', '.join(missing)}, which torch "
        f"{torch.__version__} lacks; install a newer torch (2.14 is tested)"
    )


def check_fsdp2() -> None:
    """Raise ``RuntimeError`` naming the installed torch when its FSDP2 lacks a method of :data:`FSDP2_METHODS`."""
    why = fsdp2_lacks()
    if why is not None:
        raise RuntimeError(why)


def _to_meta(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` on the meta device with its tied parameters still one parameter (``Module.to`` gives each module
    that holds a tied parameter a converted parameter of its own, untying the LM head from the embedding)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    model = model.to("meta")
    for tied in names.values():
        first = model.get_parameter(tied[0])
        for name in tied[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)
    return model


def _inputs_require_grad(module: torch.nn.Module, args: tuple[object, ...], output: torch.Tensor) -> None:
    """Forward hook of a frozen input embedding: its output requires grad in a forward with grad enabled."""
    if torch.is_grad_enabled():
        output.requires_grad_(True)


def _own_counts(moments: Mapping[str, ValueType]) -> dict[str, ValueType]:
    """One parameter's optimizer state with its unsharded tensors (the step count) copied."""
    return {
        k: v.clone() if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) else v for k, v in moments.items()
    }


class FSDPTrainEngine:
    """:class:`~relax_services.engines.TrainEngine` over ``torch.distributed.fsdp.fully_shard``.

    Every rank of the mesh constructs the engine (collectively) with the same model weights, and calls
    :meth:`step`, :meth:`compute_logprobs`, :meth:`policy_state` and :meth:`state_dict` with the same arguments
    in the same order: each of them runs collectives.

    Args:
        model: The policy (a Qwen2.5-Omni thinker) or, in :class:`FSDPValueEngine`, the critic; sharded in
            place, so hand each rank its own copy. A rank other than the group's rank 0 may hand the model built on
            the meta device (no weights): it then receives rank 0's weights, broadcast tensor by tensor and sharded
            on arrival, so the whole model exists on rank 0 only.
        config: Optimizer and loss settings, as for the single-process engine; ``micro_batch_size`` is per rank.
        fsdp: Sharding settings.
        mesh: A 1-D data-parallel mesh of the ranks that train together; defaults to every rank of the default
            process group on ``config.device``'s type.
        tp_mesh: A 1-D tensor-parallel mesh (the same parent mesh as ``mesh``): the decoder blocks are split over
            it (:mod:`~relax_services.engines.fsdp.tensor_parallel`) before FSDP shards over ``mesh``; its ranks
            train on the same data. None: no tensor parallelism.
        sp_mesh: A 1-D sequence-parallel mesh (the same parent mesh as ``mesh``): every sequence of a micro-batch
            is split over its ranks (:mod:`~relax_services.engines.fsdp.sequence_parallel`), which train on the same
            samples; FSDP then shards over ``mesh × sp_mesh`` flattened, summing the slices' gradients. None: no
            sequence parallelism.
        reference: With ``config.full_kl``, the frozen reference policy (the initial checkpoint) this rank holds;
            None takes a copy of ``model`` (which must then hold its weights, not the meta device's). Every rank
            keeps its own whole copy in ``config.reference_dtype``, not a shard: the reference only runs forwards
            without grad (no gradients, no optimizer state: 2 bytes a parameter in bfloat16, an eighth of what one
            trained parameter costs unsharded), and a whole copy needs no collective at all, where a sharded one
            would all-gather every block's weights again in each micro-batch's reference forward. A model too
            large for one rank's copy is a case for sharding it the same way as the policy.

    Attributes:
        group, rank, world_size: The data-parallel group (``mesh``'s), this rank in it and its size: batch
            shares, gathered scores and summed metrics run over it.
        shard_group, shard_rank: Every rank holding a piece of the model (:func:`shard_group`: dp × sp × tp)
            and this rank in it: checkpoints and exports run over it.
        fsdp_mesh: The mesh FSDP shards over: ``mesh``, or ``dp × sp`` flattened.
        sequence_parallel: The sequence-parallel group (None without one).

    Raises:
        RuntimeError: If no process group is initialised.
        ValueError: If ``mesh`` is not 1-D, ``tp_mesh`` or ``sp_mesh`` is given and a mesh has no dimension name,
            or sequence parallelism is asked with packing or of a model it cannot split (heads, attention).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: TorchTrainConfig | None = None,
        fsdp: FSDPConfig | None = None,
        mesh: DeviceMesh | None = None,
        tp_mesh: DeviceMesh | None = None,
        reference: torch.nn.Module | None = None,
        sp_mesh: DeviceMesh | None = None,
    ) -> None:
        if mesh is None and not dist.is_initialized():
            raise RuntimeError(
                "FSDPTrainEngine needs torch.distributed: call init_process_group first (gloo on CPU, nccl on GPU)"
            )
        check_fsdp2()
        self.config = config or TorchTrainConfig()
        if self.config.packing:
            check_packing(model.thinker if isinstance(model, ValueModel) else model)
        self.fsdp = fsdp or FSDPConfig()
        torch.manual_seed(self.config.seed)
        self.device = torch.device(self.config.device)
        if mesh is None:
            mesh = init_device_mesh(self.device.type, (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
        if mesh.ndim != 1:
            raise ValueError(f"FSDPTrainEngine needs a 1-D data-parallel mesh, got {mesh.ndim} dimensions")
        self.mesh = mesh
        self.group = mesh.get_group()
        self.world_size = mesh.size()
        self.rank = mesh.get_local_rank()
        self.tp_mesh = tp_mesh if tp_mesh is not None and tp_mesh.size() > 1 else None
        self.sequence_parallel = self._sequence_parallel(model, sp_mesh)
        self.fsdp_mesh = mesh if self.sequence_parallel is None else joined_mesh([mesh, cast(DeviceMesh, sp_mesh)])
        self.shard_group = shard_group(self.fsdp_mesh, self.tp_mesh)
        self.shard_rank = dist.get_rank(self.shard_group)
        empty = any(p.is_meta for p in model.parameters())
        if self.config.full_kl and reference is None and empty:
            raise ValueError("FSDPTrainEngine: a rank built on the meta device needs the full KL's reference model")
        reference_copy = frozen_reference(self.config, self.device, model, reference)
        if self.config.lora is not None:
            model = self._with_adapters(model)
        from_rank0 = self._any_rank(empty)
        if from_rank0 and self.shard_rank == 0 and empty:
            raise ValueError("FSDPTrainEngine: rank 0 of the group must hold the weights the other ranks receive")
        full: dict[str, torch.Tensor] = {}
        buffers: dict[str, torch.Tensor] = {}  # every buffer: the state dict lacks the non-persistent ones
        if from_rank0:
            # Rank 0's full weights (detached: they keep the storage, no copy) go to every rank once the model is
            # sharded; rank 0's own model goes to the meta device too, so that every rank shards (and splits for
            # tensor parallelism, whose distribution of a real tensor would wait for a broadcast the meta ranks
            # never join) the same empty model.
            if self.shard_rank == 0:
                full = {name: value.detach() for name, value in model.state_dict().items()}
                buffers = {name: value.detach() for name, value in model.named_buffers()}
            model = _to_meta(model)
        self.model = model if from_rank0 else model.to(self.device)
        if self.sequence_parallel is not None:
            enable_sequence_parallel(self.model.thinker if isinstance(self.model, ValueModel) else self.model)
        self.root = ScoringRoot(self.model, self.config, self.device, reference_copy, self.sequence_parallel)
        if self.tp_mesh is not None:
            from relax_services.engines.fsdp.tensor_parallel import parallelize_decoder

            parallelize_decoder(decoder_blocks(self.model), self.tp_mesh)
        self._track_usage()
        self._shard()
        if from_rank0:
            self._receive_from_rank0(full, buffers)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.config.lr_factor)
        self._version = 0

    def _with_adapters(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` with ``config.lora``'s adapters injected, before sharding, on every rank alike.

        Every rank draws ``A`` from the same seeded RNG (``B`` is zero), a rank on the meta device too (peft draws
        on the CPU, then moves the adapter to its base layer's device); when ranks receive rank 0's weights, the
        adapters are among them, so every rank starts from rank 0's.
        """
        assert self.config.lora is not None
        if self.tp_mesh is not None or self.sequence_parallel is not None:
            raise ValueError(
                "FSDPTrainEngine: LoRA (config.lora) trains with data parallelism only; tensor parallelism "
                f"(tp={1 if self.tp_mesh is None else self.tp_mesh.size()}) and sequence parallelism "
                f"(sp={1 if self.sequence_parallel is None else self.sequence_parallel.size}) are not supported with "
                "adapters: give neither tp_mesh nor sp_mesh"
            )
        if isinstance(model, ValueModel):
            raise ValueError("FSDPTrainEngine: LoRA (config.lora) adapts a policy; a critic trains every weight")
        model = apply_lora(model, self.config.lora)
        # FSDP hooks a block's gradient reduction onto its inputs' backward when they require grad, and otherwise
        # reduces it in the backward's final callback, after the root group's. With the embedding frozen, block 0's
        # input requires grad only when the micro-batch holds media (whose encoders carry adapters): ranks whose
        # micro-batches differ would reduce in different orders, a collective mismatch. Embeddings that require
        # grad give every block its hook on every rank (the adapters' gradients are the same either way).
        cast(Any, model).get_input_embeddings().register_forward_hook(_inputs_require_grad)
        return model

    def _sequence_parallel(self, model: torch.nn.Module, sp_mesh: DeviceMesh | None) -> SequenceParallel | None:
        """The sp group of ``sp_mesh`` (None for none or one rank), after checking that it can split ``model``."""
        if sp_mesh is None or sp_mesh.size() == 1:
            return None
        sp = sp_mesh.size()
        if self.config.packing:
            raise ValueError(
                f"sequence parallelism (sp={sp}) splits padded rows; trainer.packing packs a micro-batch's responses "
                "into one row: use one or the other"
            )
        tp = 1 if self.tp_mesh is None else self.tp_mesh.size()
        check_sequence_parallel(model.thinker if isinstance(model, ValueModel) else model, sp, tp)
        return SequenceParallel.of(sp_mesh)

    def _any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank of the shard group (a collective)."""
        value = torch.tensor([1.0 if flag else 0.0], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.shard_group)
        return bool(value.item() > 0)

    def _receive_from_rank0(self, full: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        """Fill the shards of ranks built on the meta device from rank 0's full weights (each tensor broadcast once
        and sharded on arrival), so only rank 0 ever loads the checkpoint or holds the whole model; buffers that
        are not in the state dict (rotary frequencies) are broadcast too."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        self.model.to_empty(device=self.device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(self.model, dict[str, Any](full), options=options)
        for name, buffer in self.model.named_buffers():
            if self.shard_rank == 0:
                buffer.copy_(buffers[name])
            dist.broadcast(buffer, group_src=0, group=self.shard_group)
        full.clear()
        buffers.clear()

    @property
    def mixed_precision_enabled(self) -> bool:
        """Whether the gathered parameters are bf16 (with fp32 gradient reduction)."""
        if self.fsdp.mixed_precision == "auto":
            return self.device.type == "cuda"
        return self.fsdp.mixed_precision == "bf16"

    def _shard(self) -> None:
        mp = MixedPrecisionPolicy()
        if self.mixed_precision_enabled:
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy() if self.fsdp.cpu_offload and self.device.type == "cuda" else OffloadPolicy()
        units: list[torch.nn.Module] = []
        for block in decoder_blocks(self.model):
            if self.fsdp.activation_checkpointing:
                from torch.distributed._composable.checkpoint_activation import checkpoint

                checkpoint(block)  # before sharding, as the one-process engine's blocks
            fully_shard(
                block,
                mesh=self.fsdp_mesh,
                mp_policy=mp,
                reshard_after_forward=self.fsdp.reshard_after_forward,
                offload_policy=offload,
            )
            units.append(block)
        fully_shard(self.root, mesh=self.fsdp_mesh, mp_policy=mp, offload_policy=offload)
        units.append(self.root)
        for unit in units:
            assert isinstance(unit, FSDPModule)
            # Each rank's loss is already its share of the whole batch's loss: the gradients must add up, not
            # average (the reduction's default divides by the world size). Plain SUM collectives: the factor
            # would otherwise become a PREMUL_SUM, which gloo lacks.
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_reduce_scatter_unused_params(True, recurse=False)

    @property
    def version(self) -> int:
        """Policy updates (:meth:`step` calls) applied so far."""
        return self._version

    @property
    def autocast_enabled(self) -> bool:
        """Whether forwards run under bf16 autocast (as in the single-process engine)."""
        return autocast_enabled(self.config, self.device)

    def _autocast(self) -> AbstractContextManager[object]:
        return autocast_context(self.config, self.device)

    def score(self, batch: Sequence[TrainSample], full_kl: bool = False) -> TokenScores:
        """Forward over one of this rank's micro-batches (collective: every rank scores one at the same time); the
        per-token full KL only ``full_kl`` (with the frozen reference)."""
        with self._autocast():
            logprobs, entropy, mask, values, kl = self.root(
                [s.prompt for s in batch], [s.response_ids for s in batch], full_kl
            )
        return TokenScores(logprobs=logprobs, entropy=entropy, mask=mask, values=values, full_kl=kl)

    # -- sharding of a batch over the ranks ----------------------------------------------------------------------

    def _micro_batches(self, share: Sequence[TrainSample]) -> list[Sequence[TrainSample]]:
        """This rank's micro-batches (collective with a token budget: every rank cuts its share into as many as the
        rank that needs the most, since each forward gathers the sharded weights)."""
        if self.config.max_tokens_per_micro_batch is None:
            return self.config.micro_batches(share)
        own = len(self.config.micro_batches(share))
        return self.config.micro_batches(share, int(self._all_reduce(torch.tensor([float(own)]), dist.ReduceOp.MAX)[0]))

    def _share(self, batch: Sequence[TrainSample], what: str) -> Sequence[TrainSample]:
        """This rank's contiguous slice of ``batch`` (consecutive samples, so whole groups stay together when the
        group size divides the slice)."""
        if not batch:
            raise ValueError(f"cannot {what} an empty batch")
        if len(batch) % self.world_size:
            raise ValueError(
                f"cannot {what} a batch of {len(batch)} samples on {self.world_size} ranks: the size must be a "
                f"multiple of the world size (every rank runs the same number of forwards)"
            )
        size = len(batch) // self.world_size
        return batch[self.rank * size : (self.rank + 1) * size]

    def _counts(self, batch: Sequence[TrainSample]) -> list[float]:
        """Per-sample weights before normalisation: trained response tokens, or 1 per sample."""
        if self.config.loss_weighting == "samples":
            return [1.0] * len(batch)
        banned = torch.tensor(sorted(self.config.suppressed_ids), dtype=torch.long)
        return [trained_tokens(s, banned) for s in batch]

    # -- TrainEngine ---------------------------------------------------------------------------------------------

    def compute_logprobs(self, batch: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(logprobs [B, L], mask [B, L])`` of the whole batch on CPU, without grad: each rank scores
        its share and the shares are gathered."""
        scores = self._score_without_grad(batch)
        return scores.logprobs, scores.mask

    def compute_scores(self, batch: Sequence[TrainSample]) -> TokenScores:
        """:class:`TokenScores` (log-probs, entropy, mask) of the whole batch on CPU, without grad."""
        return self._score_without_grad(batch)

    def _score_without_grad(self, batch: Sequence[TrainSample]) -> TokenScores:
        pin_intra_op_threads(self.config.intra_op_threads)
        share = self._share(batch, "score")
        was_training = self.model.training
        self.root.eval()
        with torch.no_grad():
            parts = [self.score(micro) for micro in self._micro_batches(share)]
        self.root.train(was_training)
        length = max(p.mask.shape[1] for p in parts)
        length = int(self._all_reduce(torch.tensor([float(length)]), dist.ReduceOp.MAX)[0])

        def gather(tensors: list[torch.Tensor]) -> torch.Tensor:
            local = torch.cat([_pad_to(x, length) for x in tensors]).float()
            return self._all_gather(local).cpu()

        has_values = parts[0].values is not None
        return TokenScores(
            logprobs=gather([p.logprobs for p in parts]),
            entropy=gather([p.entropy for p in parts]),
            mask=gather([p.mask for p in parts]),
            values=gather([p.values for p in parts if p.values is not None]) if has_values else None,
        )

    def step(self, batch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        """One policy update (one version): ``epochs × minibatches`` optimizer steps over consecutive equal slices
        of ``batch``, each rank taking its share of every slice; then one LR schedule step.

        Every rank passes the same ``batch``; each slice must be a multiple of the world size.

        Returns:
            The single-process engine's metrics (``loss``, ``entropy``, ``tokens``, ``grad_norm``, ``loss_fn``'s
            own, ``lr``, ``step_s``, ``version``), over the whole batch and equal on every rank.
        """
        if len(batch) % self.config.minibatches:
            raise ValueError(
                f"a batch of {len(batch)} samples does not split into {self.config.minibatches} equal minibatches"
            )
        pin_intra_op_threads(self.config.intra_op_threads)
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

    def _optimizer_step(self, minibatch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        self.optimizer.zero_grad(set_to_none=True)
        self._used.zero_()
        metrics = self._accumulate_gradients(minibatch, loss_fn)
        self._drop_unused_gradients()
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        metrics["grad_norm"] = clip_gradients(params, max_norm)  # over the DTensor shards: the global norm
        self.optimizer.step()
        return metrics

    def _track_usage(self) -> None:
        """Marks, per optimizer step, the parameters whose module ran a forward with grad enabled."""
        index = {name: i for i, (name, _) in enumerate(self.model.named_parameters())}
        self._used = torch.zeros(len(index))
        for prefix, module in self.model.named_modules():
            mine = [index[f"{prefix}.{n}" if prefix else n] for n, p in module.named_parameters(recurse=False)]
            if mine:
                module.register_forward_hook(self._usage_hook(torch.tensor(mine)))

    def _usage_hook(self, positions: torch.Tensor) -> Callable[[torch.nn.Module, tuple[object, ...], object], None]:
        def hook(module: torch.nn.Module, args: tuple[object, ...], output: object) -> None:
            if torch.is_grad_enabled():
                self._used[positions] = 1.0

        return hook

    def _drop_unused_gradients(self) -> None:
        """Sets ``.grad = None`` on the parameters no rank used in this optimizer step, as one process leaves
        them: AdamW then skips them (no momentum step, no state) exactly as it does in one process.

        The reduction gives every parameter of a group a gradient, zeros where a rank did not use it (the
        encoders of a modality absent from a rank's share), so that all ranks reduce-scatter the same tensors.
        Which parameters were used is recorded by forward hooks, not read from the values: a used parameter
        can have an all-zero gradient (the backbone behind a zero-initialised value head), and one process
        steps it.
        """
        # Over every rank holding a shard (dp × sp × tp): a sequence-parallel rank may not have run an encoder its
        # peer ran for both (the peer encoded their shared micro-batch's media), and each steps its own shard.
        used = self._used.to(self.device)
        dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.shard_group)
        used = used.cpu()
        for p, flag in zip(self.model.parameters(), used.tolist(), strict=True):
            if not flag:
                p.grad = None

    def _accumulate_gradients(self, minibatch: Sequence[TrainSample], loss_fn: LossFn) -> dict[str, float]:
        """Backward of this rank's part of ``Σ_m w_m · loss_fn(m)``, ``w_m`` the micro-batch's share of the whole
        minibatch's tokens (or samples); metrics of the whole minibatch."""
        counts = self._counts(minibatch)
        total = sum(counts)
        if total == 0:
            raise ValueError("batch has no unmasked response tokens to train on")
        share = self._share(minibatch, "train on")
        first = self.rank * len(share)
        self.root.train()
        local: dict[str, float] = {"loss": 0.0, "entropy": 0.0, "tokens": 0.0}
        offset = first
        units: list[float | None] = []
        micro_batches = self._micro_batches(share)
        for micro in micro_batches:
            weight = sum(counts[offset : offset + len(micro)]) / total
            offset += len(micro)
            units.append(backward_micro_batch(loss_fn, micro, self.score(micro, self.config.full_kl), weight, local))
        local_units = units_of_step(units)
        # Summed with the metrics (every rank joins that collective whatever form its loss returned).
        local["_units"] = local_units or 0.0
        local["_plain_ranks"] = 1.0 if local_units is None else 0.0
        local["_run"], local["_real"] = map(float, padded_response_slots(micro_batches, self.config.packing))
        totals = self._sum_metrics(local)
        step_units, plain_ranks = totals.pop("_units"), totals.pop("_plain_ranks")
        run, real = totals.pop("_run"), totals.pop("_real")  # the group's response positions and tokens
        if 0 < plain_ranks < self.world_size:
            raise ValueError("loss_fn returned a LossResult on some ranks and a plain loss on others")
        if plain_ranks == 0:
            # Gradients were reduce-scattered as sums (divide factor 1): dividing the shards by the units of the
            # whole step gives the single-process engine's gradient.
            rescale_by_units(self.model.parameters(), totals, step_units)
        totals["entropy"] /= max(totals["tokens"], 1.0)
        totals["padding_frac"] = (run - real) / real
        return totals

    def policy_state(self, keep: bool = True) -> dict[str, torch.Tensor]:
        """Full (unsharded) CPU copies of the weights (collective: gathers one tensor at a time); ``keep=False``
        takes part in the gathers and returns ``{}`` (the ranks whose copy nobody reads: only one full copy is
        made in the group). With ``config.lora``: the adapters merged in, under the plain model's names, as the
        single-process engine publishes them (:func:`~relax_services.models.lora.merge_adapters`)."""
        from relax_services.weights.buckets import full_tensors

        full = dict(full_tensors(self.model, keep=keep))
        return merge_adapters(self.model, full) if self.config.lora is not None and keep else full

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """With ``config.lora``: full CPU copies of the adapters under the adapted model's names, on every rank
        (collective), as :func:`~relax_services.models.lora.adapter_state` gives them in one process."""
        if self.config.lora is None:
            raise ValueError("FSDPTrainEngine.adapter_state: the engine trains every weight (config.lora is None)")
        entries = trainable_state(self.model, StateDictOptions(full_state_dict=True, cpu_offload=True))
        return cast(dict[str, torch.Tensor], entries)

    def train_state(self, options: StateDictOptions | None = None) -> tuple[dict[str, ValueType], OptimizerStateType]:
        """Model and optimizer entries keyed by name (:func:`~relax_services.engines.fsdp.state.train_state`); with
        ``config.lora`` the model's are the adapters alone (the frozen weights are the checkpoint folder's)."""
        return train_state(self.model, self.optimizer, options, trainable_only=self.config.lora is not None)

    def state_dict(self) -> dict[str, Any]:
        """This rank's shards: model (with ``config.lora`` its adapters) and optimizer as DTensors keyed by parameter
        name (what ``torch.distributed.checkpoint`` saves and reshards), scheduler, this rank's RNG states and
        version. Copies, not views of the live state."""
        model_state, optim_state = self.train_state()
        rng: dict[str, Any] = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "model": clone_state(model_state),
            "optimizer": clone_state(optim_state),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng,
            "version": self._version,
        }

    def full_state_dict(self) -> dict[str, object]:
        """:meth:`state_dict` gathered: full (unsharded) CPU tensors keyed by parameter name, which any world size
        loads (:meth:`load_full_state_dict`); collective, and only the shard group's rank 0 is sure to get every
        entry (torch's gathers leave the others' empty). With ``config.lora`` the model entries are the adapters,
        named as the single-process engine's (what :func:`~relax_services.models.export.export_checkpoint` reads)."""
        model_state, optim_state = self.train_state(StateDictOptions(full_state_dict=True, cpu_offload=True))
        # The gathered tensors are new, but AdamW's step counts (plain tensors, not sharded) come back as the live
        # ones, which the next update would advance under the caller's feet.
        moments = cast("dict[str, dict[str, ValueType]]", optim_state.get("state", {}))
        optim_state = {**optim_state, "state": {name: _own_counts(entry) for name, entry in moments.items()}}
        return {
            "model": model_state,
            "optimizer": optim_state,
            "scheduler": self.scheduler.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "version": self._version,
        }

    def load_full_state_dict(self, state: Mapping[str, object]) -> None:
        """Restores :meth:`full_state_dict` (of any world size), given whole on every rank (collective)."""
        # strict=False: see load_state_dict; a LoRA state's model entries are the adapters alone (the rest stays)
        options = StateDictOptions(full_state_dict=True, strict=False)
        model_state, optim_state = (
            cast("Mapping[str, object]", state["model"]),
            cast("Mapping[str, object]", state["optimizer"]),
        )
        load_train_state(self.model, self.optimizer, model_state, optim_state, options)
        self.scheduler.load_state_dict(cast("dict[str, Any]", state["scheduler"]))
        torch.set_rng_state(cast("dict[str, torch.Tensor]", state["rng"])["torch"])
        self._version = int(cast(int, state["version"]))

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores :meth:`state_dict` (model and optimizer entries as DTensors on this mesh, or full tensors)."""
        # strict=False: a parameter that never had a gradient has no optimizer state.
        load_train_state(self.model, self.optimizer, state["model"], state["optimizer"], StateDictOptions(strict=False))
        self.scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"]["torch"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self._version = int(state["version"])

    def shutdown(self) -> None:
        """Nothing to release: the rank process that runs this engine owns its process group."""

    # -- collectives over the mesh -------------------------------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        out = tensor.to(self.device)
        dist.all_reduce(out, op=op, group=self.group)
        return out.cpu()

    def _all_gather(self, local: torch.Tensor) -> torch.Tensor:
        """Concatenation along dim 0 of every rank's equally shaped ``local``, in rank order."""
        local = local.to(self.device).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts)

    def _sum_metrics(self, local: dict[str, float]) -> dict[str, float]:
        """Sums of every rank's metrics, added in rank order (the same floats on every rank)."""
        gathered: list[dict[str, float] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, local, group=self.group)
        keys = set(local)
        if any(g is None or set(g) != keys for g in gathered):
            raise ValueError(f"loss_fn returned different metric names on different ranks: {gathered}")
        return {k: sum(g[k] for g in gathered if g is not None) for k in local}


class FSDPValueEngine(FSDPTrainEngine):
    """Trains a critic (:class:`~relax_services.models.ValueModel`) sharded like the policy; the loss function
    reads ``inputs.values``."""

    model: ValueModel

    def compute_values(self, batch: Sequence[TrainSample]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(values [B, L], mask [B, L])`` of the whole batch on CPU, without grad."""
        scores = self._score_without_grad(batch)
        assert scores.values is not None, "score_values sets values"
        return scores.values, scores.mask

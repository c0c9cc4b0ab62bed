"""Run-config rules of the Trainer group (``trainer.world_size``), kept out of ``config.py`` so that module stays
the field list; light (no torch), as the config must load without the model stack."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_services.config import RunConfig

__all__ = [
    "GROUP_TRAIN_ENGINES",
    "check_sequence_parallel_heads",
    "check_trainer_group",
    "data_parallel",
    "default_train_engine",
    "rank_split",
    "single_process",
]

GROUP_TRAIN_ENGINES: frozenset[str] = frozenset({"fsdp"})
"""``trainer.engine`` ids that run the Trainer as a group of ``trainer.world_size`` ranks; every other engine is
one process."""


def default_train_engine(data: object) -> object:
    """``trainer.engine`` when not given: ``fsdp`` for ``world_size`` > 1, so ``trainer.world_size=2`` alone makes
    a valid run (the chosen id is then written in the run's saved config, not re-derived on ``--resume``)."""
    if isinstance(data, dict) and "engine" not in data:
        world = data.get("world_size", 1)
        if isinstance(world, int) and not isinstance(world, bool) and world > 1:
            return {**data, "engine": "fsdp"}
    return data


def data_parallel(cfg: RunConfig) -> int:
    """Data-parallel ranks of the Trainer: ``world_size / (tensor_parallel × sequence_parallel)`` (the ranks of one
    tensor- or sequence-parallel group train on the same samples)."""
    return max(1, cfg.trainer.world_size // (cfg.trainer.tensor_parallel * cfg.trainer.sequence_parallel))


def rank_split(cfg: RunConfig) -> tuple[int, int]:
    """``(samples per minibatch, samples per data-parallel rank of it)`` of one update."""
    per_minibatch = cfg.trainer.groups_per_step // cfg.trainer.minibatches * cfg.algorithm.group_size
    return per_minibatch, per_minibatch // data_parallel(cfg)


def check_trainer_group(cfg: RunConfig) -> None:
    """The rules ``trainer.world_size`` adds to a run config.

    Every rank trains on an equal, contiguous share of each minibatch (the FSDP engine's split), so the
    samples of a minibatch, ``groups_per_step / minibatches × group_size``, must be a multiple of the world size;
    the ranks hold whole groups when ``groups_per_step / minibatches`` is one. A group split between ranks
    trains exactly as a whole one (advantages are computed over the whole batch before the update, and the loss
    is a token- or sample-weighted sum), so only equal shares are required. With ``algorithm.filter_groups``
    the number of groups kept varies per update, so the group size itself must be a multiple.

    Raises:
        ValueError: A rule broken, naming the fields.
    """
    trainer = cfg.trainer
    world = trainer.world_size
    if world > 1 and trainer.engine not in GROUP_TRAIN_ENGINES:
        raise ValueError(
            f"trainer.world_size={world} needs a multi-rank trainer.engine ({', '.join(sorted(GROUP_TRAIN_ENGINES))}); "
            f"trainer.engine={trainer.engine!r} runs in one process"
        )
    if trainer.engine in GROUP_TRAIN_ENGINES and cfg.run.mode == "colocated":
        raise ValueError(
            f"trainer.engine={trainer.engine!r} runs its ranks as Ray actors; run.mode='colocated' runs without "
            "Ray: use run.mode=distributed"
        )
    for fault in cfg.faults:
        if fault.kind == "kill_rank" and (fault.service != "trainer" or trainer.engine not in GROUP_TRAIN_ENGINES):
            raise ValueError(
                f"faults: kind 'kill_rank' hits a rank of the Trainer group (service: trainer, trainer.engine in "
                f"{sorted(GROUP_TRAIN_ENGINES)}); got service {fault.service!r}, trainer.engine={trainer.engine!r}"
            )
    splits = {"tensor_parallel": trainer.tensor_parallel, "sequence_parallel": trainer.sequence_parallel}
    if cfg.model.lora is not None and (split := {k: v for k, v in splits.items() if v > 1}):
        raise ValueError(
            f"model.lora trains adapters with data parallelism only (trainer.engine={trainer.engine!r}, "
            f"trainer.world_size={world}); {', '.join(f'trainer.{k}={v}' for k, v in split.items())} is not supported "
            "with adapters: use trainer.tensor_parallel=1 and trainer.sequence_parallel=1, or full fine-tuning "
            "(model.lora=null)"
        )
    tp = trainer.tensor_parallel
    if tp > 1 and trainer.engine not in GROUP_TRAIN_ENGINES:
        raise ValueError(
            f"trainer.tensor_parallel={tp} needs a multi-rank trainer.engine ({', '.join(sorted(GROUP_TRAIN_ENGINES))})"
            f"; trainer.engine={trainer.engine!r} runs in one process"
        )
    if world % tp:
        raise ValueError(f"trainer.tensor_parallel={tp} must divide trainer.world_size={world}")
    _check_sequence_parallel(cfg)
    dp = data_parallel(cfg)
    if dp == 1:
        return
    per_minibatch, _ = rank_split(cfg)
    sp = trainer.sequence_parallel
    if sp > 1:
        ranks = f"trainer.world_size / (tensor_parallel × sequence_parallel) = {world} / ({tp} × {sp}) = {dp}"
    else:
        ranks = f"trainer.world_size={world}" if tp == 1 else f"trainer.world_size / tensor_parallel = {dp}"
    if per_minibatch % dp:
        raise ValueError(
            f"{ranks} must divide the samples of each minibatch, trainer.groups_per_step="
            f"{trainer.groups_per_step} / trainer.minibatches={trainer.minibatches} × algorithm.group_size="
            f"{cfg.algorithm.group_size} = {per_minibatch} (every rank trains on an equal share)"
        )
    if cfg.algorithm.filter_groups and cfg.algorithm.group_size % dp:
        raise ValueError(
            f"{ranks} must divide algorithm.group_size={cfg.algorithm.group_size} with "
            "algorithm.filter_groups (the groups kept per update vary, and every rank trains on an equal share)"
        )


def _check_sequence_parallel(cfg: RunConfig) -> None:
    """``trainer.sequence_parallel``'s rules: a group engine, a divisor of the ranks left by tensor parallelism,
    padded rows (not packing). Its divisibility of the model's heads is checked when the engine is built (and by
    ``relax train --dry-run``, which reads the checkpoint's config)."""
    trainer = cfg.trainer
    sp, tp, world = trainer.sequence_parallel, trainer.tensor_parallel, trainer.world_size
    if sp == 1:
        return
    if trainer.engine not in GROUP_TRAIN_ENGINES:
        raise ValueError(
            f"trainer.sequence_parallel={sp} needs a multi-rank trainer.engine "
            f"({', '.join(sorted(GROUP_TRAIN_ENGINES))}); trainer.engine={trainer.engine!r} runs in one process"
        )
    if (world // tp) % sp:
        raise ValueError(
            f"trainer.sequence_parallel={sp} must divide trainer.world_size / tensor_parallel = {world} / {tp} = "
            f"{world // tp}"
        )
    if trainer.packing:
        raise ValueError(
            f"trainer.sequence_parallel={sp} splits padded rows; trainer.packing=true packs a micro-batch's responses "
            "into one row: set trainer.packing=false or trainer.sequence_parallel=1"
        )


def check_sequence_parallel_heads(cfg: RunConfig, checkpoint_config: Mapping[str, object]) -> None:
    """``trainer.sequence_parallel`` against the model (its checkpoint's ``config.json``, read before anything loads):
    the Ulysses exchange gives every sp rank ``heads / (tensor_parallel × sequence_parallel)`` attention heads, so
    that must divide (key/value heads need only tensor parallelism's rule: the exchange expands them when ``sp``
    does not divide them).

    Raises:
        ValueError: If they do not, naming the field, the model's numbers and the degrees.
    """
    sp, tp = cfg.trainer.sequence_parallel, cfg.trainer.tensor_parallel
    if sp == 1:
        return
    text = dict(checkpoint_config)
    for key in ("thinker_config", "text_config"):  # an omni model's thinker, a VL model's text decoder
        inner = text.get(key)
        if isinstance(inner, Mapping):
            text = dict(inner)
    inner = text.get("text_config")
    if isinstance(inner, Mapping):
        text = dict(inner)
    heads = text.get("num_attention_heads")
    if not isinstance(heads, int):
        return  # not a decoder config this reads; the engine checks the loaded model
    if heads % (tp * sp):
        raise ValueError(
            f"trainer.sequence_parallel={sp} × trainer.tensor_parallel={tp} must divide the model's attention heads "
            f"({heads}): each sequence-parallel rank attends with {heads} / (tp × sp) of them"
        )


def single_process(cfg: RunConfig) -> RunConfig:
    """``cfg`` with a one-process training engine in place of a group one (``torch``, world size 1): for the
    services that only score with the trainer's kind of engine (the Reference), where a second group of ranks
    would double the Trainer's processes for no gain on models that fit one device."""
    if cfg.trainer.engine not in GROUP_TRAIN_ENGINES:
        return cfg
    trainer = cfg.trainer.model_copy(
        update={"engine": "torch", "world_size": 1, "tensor_parallel": 1, "sequence_parallel": 1}
    )
    return cfg.model_copy(update={"trainer": trainer})

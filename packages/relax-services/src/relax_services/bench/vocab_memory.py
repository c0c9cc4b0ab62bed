"""Peak memory of one training update against the vocabulary size: the sampled-token KL (k3) beside the exact
full-vocabulary KL (``algorithm.kl_estimator=full``), both scored a chunk of tokens at a time.

Each vocabulary V gets a tiny Qwen2 checkpoint of the same width whose embedding and LM head are padded to V rows
(:func:`~relax_services.models.tiny_families.write_tiny_checkpoint`'s ``shape``), the run config's training engine
(:func:`~relax_services.engines.torch.build_train_engine`) and the same batch of token ids.
:func:`~relax_services.bench.peak_memory.peak_bytes` counts what one ``engine.step`` (the first: it allocates the
gradients and Adam's state) holds at most. What grows with V is the embedding and LM head's parameter bytes P_V,
held at most four times at once (gradients, Adam's two moments, and the ``sqrt`` of the second one that the
update builds), plus, in the scoring, a few ``[chunk, V]`` tensors: the policy's for k3, the policy's and the
reference's for the full KL (the engine's frozen reference computes its ``[chunk, V]`` log-probs in the same chunk;
no ``[B, L, V]`` tensor and no ``[L, V]`` field exists). The peak is the largest of the phases' live bytes
``c + a·P_V + s_V`` with ``a <= 4`` and ``s_V`` the scoring's V-dependent share, so the residual ``peak − 4 P_V``
grows with V by at most the growth of ``s_V``. The full KL's engine also holds the reference's weights, its own
embedding and LM head included (``reference_head_bytes``); they exist before the step, so the step's peak does not
count them.

Run by ``benchmarks/vocab_memory.py`` (the table) and ``tests/engines/test_vocab_memory.py`` (the bound).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from relax_services.bench.peak_memory import peak_bytes
from relax_services.config import load_run_config
from relax_services.engines import TrainSample
from relax_services.engines.torch import build_train_engine
from relax_services.models import OmniPrompt
from relax_services.models.tiny_families import write_tiny_checkpoint
from relax_services.services.trainer import make_loss_fn

__all__ = [
    "HIDDEN",
    "OPTIMIZER_COPIES",
    "StepPeak",
    "VocabMemory",
    "Workload",
    "cuda_peak_bytes",
    "format_table",
    "measure_vocab",
    "step_peak",
]

OPTIMIZER_COPIES = 4
"""Copies of each parameter the first step allocates: its gradient, Adam's first and second moments, and the
``sqrt`` of the second moment that torch's multi-tensor AdamW builds for the update."""

HIDDEN = 64
"""Width of every checkpoint of the sweep (2 layers, the tiny Qwen2's other sizes)."""


@dataclass(frozen=True)
class Workload:
    """The update measured at every V.

    Attributes:
        prompts: Distinct prompts (one group each).
        group_size: Responses per prompt; B = prompts × group_size, all in one micro-batch.
        prompt_tokens: Ids per prompt.
        response_tokens: L, ids per response (all scored).
        chunk_tokens: Response tokens per LM-head chunk (``TorchTrainConfig.scoring_chunk_tokens``).
    """

    prompts: int = 2
    group_size: int = 4
    prompt_tokens: int = 32
    response_tokens: int = 256
    chunk_tokens: int = 64

    @property
    def tokens(self) -> int:
        """B · L, the response tokens of the batch."""
        return self.prompts * self.group_size * self.response_tokens


@dataclass(frozen=True)
class StepPeak:
    """One update's measurement (bytes)."""

    peak: int  # the most bytes the step held at once beyond what existed before it
    head_bytes: int  # P_V: the policy's embedding and LM head parameters
    reference_head_bytes: int  # the frozen reference's embedding and LM head (0 without one)


@dataclass(frozen=True)
class VocabMemory:
    """One vocabulary size's measurement (bytes)."""

    vocab: int
    head_bytes: int  # P_V: the embedding's and the LM head's parameters
    k3_peak: int  # one step with the sampled-token KL (k3)
    full_peak: int  # one step with kl_estimator=full: the exact KL, chunked against the engine's reference
    reference_head_bytes: int  # the full KL engine's frozen reference: its embedding and LM head, held throughout

    @property
    def k3_residual(self) -> int:
        """``k3_peak − 4 P_V``: the k3 step's memory beyond the embedding and head's optimizer copies."""
        return self.k3_peak - OPTIMIZER_COPIES * self.head_bytes

    @property
    def full_residual(self) -> int:
        """``full_peak − 4 P_V``: the full-KL step's memory beyond the embedding and head's optimizer copies."""
        return self.full_peak - OPTIMIZER_COPIES * self.head_bytes


def _samples(work: Workload, vocab: int, suppressed: Sequence[int]) -> list[TrainSample]:
    """The same ids at every V (the tiny tokenizer's characters, 12–63), old and reference log-probs of a uniform
    policy, ±1 advantages (what the queue brings for either KL: nothing of size V)."""
    gen = torch.Generator().manual_seed(0)
    length = work.response_tokens
    support = vocab - len(suppressed)
    uniform = torch.full((length,), -math.log(support))
    samples = []
    for _ in range(work.prompts):
        prompt = OmniPrompt(torch.randint(12, 64, (work.prompt_tokens,), generator=gen))
        for j in range(work.group_size):
            fields = {
                "old_logprobs": uniform,
                "ref_logprobs": uniform,
                "advantages": torch.full((length,), j % 2 * 2.0 - 1),
            }
            samples.append(TrainSample(prompt, torch.randint(12, 64, (length,), generator=gen), fields))
    return samples


def step_peak(folder: Path, kl_estimator: str, work: Workload, device: str = "cpu") -> StepPeak:
    """One ``engine.step``'s peak and the embedding + LM head bytes for the checkpoint in ``folder``, on ``device``
    (``cpu``: the profiler's exact count; ``cuda``: the CUDA allocator's peak, bf16 autocast as a GPU run trains)."""
    cfg = load_run_config(
        None,
        [
            f"run.device={device}",
            f"model.source={folder}",
            f"algorithm.kl_estimator={kl_estimator}",
            f"algorithm.group_size={work.group_size}",
            f"trainer.groups_per_step={work.prompts}",
            f"trainer.micro_batch_groups={work.prompts}",
        ],
    )
    engine = build_train_engine(cfg)
    engine.config = dataclasses.replace(engine.config, scoring_chunk_tokens=work.chunk_tokens)
    model: Any = engine.model  # a transformers causal LM
    vocab = model.get_input_embeddings().weight.shape[0]
    batch = _samples(work, vocab, engine.config.suppressed_ids)
    loss_fn = make_loss_fn(cfg)
    metrics: dict[str, float] = {}
    measure = peak_bytes if device == "cpu" else cuda_peak_bytes
    peak = measure(lambda: metrics.update(engine.step(batch, loss_fn)))
    if not math.isfinite(metrics["loss"]):
        raise RuntimeError(f"V={vocab}, kl_estimator={kl_estimator}: the step's loss is {metrics['loss']}")
    reference = 0 if engine.reference is None else _head_bytes(engine.reference.model)
    return StepPeak(peak, _head_bytes(model), reference)


def _head_bytes(model: torch.nn.Module) -> int:
    """Bytes of a causal LM's embedding and LM head (one when tied)."""
    lm: Any = model  # a transformers causal LM
    heads = {lm.get_input_embeddings().weight, lm.get_output_embeddings().weight}
    return sum(p.numel() * p.element_size() for p in heads)


def cuda_peak_bytes(fn: Callable[[], object]) -> int:
    """The most bytes the CUDA caching allocator handed out at once while ``fn()`` ran, beyond what was allocated
    before it (``torch.cuda.max_memory_allocated``)."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def measure_vocab(vocab: int, workdir: Path, work: Workload | None = None, device: str = "cpu") -> VocabMemory:
    """Writes the V-row checkpoint under ``workdir`` and measures one step with k3 and one with the full KL on
    ``device``."""
    work = work or Workload()
    folder = write_tiny_checkpoint(
        workdir / f"qwen2-v{vocab}", "qwen2", shape={"vocab_size": vocab, "hidden_size": HIDDEN, "num_hidden_layers": 2}
    )
    k3 = step_peak(folder, "k3", work, device)
    full = step_peak(folder, "full", work, device)
    return VocabMemory(vocab, k3.head_bytes, k3.peak, full.peak, full.reference_head_bytes)


def format_table(rows: Sequence[VocabMemory]) -> str:
    """The sweep side by side, in MB (10⁶ bytes)."""

    def mb(n: int) -> str:
        return f"{n / 1e6:,.1f}"

    head = ("V", "emb+head params", "peak k3", "peak full KL", "k3 − 4P", "full KL − 4P", "reference emb+head")
    lines = [head] + [
        (
            f"{r.vocab:,}",
            mb(r.head_bytes),
            mb(r.k3_peak),
            mb(r.full_peak),
            mb(r.k3_residual),
            mb(r.full_residual),
            mb(r.reference_head_bytes),
        )
        for r in rows
    ]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines)

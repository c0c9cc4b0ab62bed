"""One training update's peak memory at two vocabulary sizes (:mod:`relax_services.bench.vocab_memory`): with
chunked scoring only the embedding, the LM head, their optimizer state and one chunk's tensors grow with V; the
dense ``[B, L, V]`` path (``algorithm.kl_estimator=full``) grows by whole batches of the vocabulary."""

from __future__ import annotations

from pathlib import Path

from relax_services.bench.vocab_memory import HIDDEN, Workload, measure_vocab

FLOAT = 4
"""Bytes of a float32: the scoring's dtype."""

CHUNK_TENSORS = 8
"""``[chunk, V]`` tensors a chunk's recomputed forward and its backward hold at once, with room: logits, scaled
logits, the support mask, log-probs, their exp, the entropy's masked copy and product, and their gradients are
fewer than 8 at any one time (the chunked-scoring test's bound counts the same 8)."""

HEAD_TEMPORARIES = 1
"""``[V, H]`` tensors beyond the gradients themselves: a chunk's LM-head weight gradient before it is added to
``.grad``."""


def test_chunked_scoring_memory_grows_by_one_chunk_of_the_vocabulary_the_dense_path_by_the_batch(
    tmp_path: Path,
) -> None:
    """Residual = peak − 4·P_V (P_V the embedding and LM head bytes: gradients, Adam's m and v and its sqrt(v)
    temporary are at most 4 copies live at once). Every phase's live bytes are ``c + a·P_V + s_V`` with ``a <= 4``,
    so the residual grows from V₁ to V₂ by at most the growth of the scoring's V-dependent tensors s_V:

    chunked: ΔV · (CHUNK_TENSORS · chunk + HEAD_TEMPORARIES · H) · 4 bytes = 28,672 · (8·64 + 64) · 4 = 66 MB;
    dense: the [B, L, V] log-probs alone are B·L·ΔV·4 = 2,048 · 28,672 · 4 = 235 MB more, held until the backward.
    The first bound is below the second (checked), so the same measurement tells the two paths apart."""
    work = Workload()
    small, large = (measure_vocab(v, tmp_path, work) for v in (4096, 32768))
    delta = large.vocab - small.vocab
    assert large.head_bytes - small.head_bytes == 2 * delta * HIDDEN * FLOAT  # untied embedding and head
    chunked_bound = delta * (CHUNK_TENSORS * work.chunk_tokens + HEAD_TEMPORARIES * HIDDEN) * FLOAT
    dense_floor = work.tokens * delta * FLOAT
    assert chunked_bound < dense_floor / 2
    assert large.chunked_residual - small.chunked_residual <= chunked_bound
    assert large.dense_residual - small.dense_residual >= dense_floor

"""One training update's peak memory at two vocabulary sizes (:mod:`relax_services.bench.vocab_memory`): with the
sampled-token KL (k3) and with the exact full-vocabulary KL (``algorithm.kl_estimator=full``), only the embedding,
the LM head, their optimizer state and one chunk's tensors grow with V; the full KL's engine also holds the frozen
reference's weights, before and after the step alike."""

from __future__ import annotations

from pathlib import Path

from relax_services.bench.vocab_memory import HIDDEN, Workload, measure_vocab

FLOAT = 4
"""Bytes of a float32: the scoring's dtype."""

CHUNK_TENSORS = 8
"""``[chunk, V]`` tensors a chunk's recomputed forward and its backward hold at once with k3, with room: logits,
scaled logits, the support mask, log-probs, their exp, the entropy's masked copy and product, and their gradients
are fewer than 8 at any one time (the chunked-scoring test's bound counts the same 8)."""

FULL_KL_CHUNK_TENSORS = 12
"""The same with the full KL, with room: k3's, and the reference's ``[chunk, V]`` log-probs, the support mask, the
clamped policy log-probs, the log-ratio, the reference's probabilities and their product, and the gradients
through them (the chunked-scoring test's bound counts the same 12; measured there: under 8 with the V-independent
tensors)."""

HEAD_TEMPORARIES = 1
"""``[V, H]`` tensors beyond the gradients themselves: a chunk's LM-head weight gradient before it is added to
``.grad``."""


def test_update_memory_grows_by_one_chunk_of_the_vocabulary_with_either_kl(tmp_path: Path) -> None:
    """Residual = peak − 4·P_V (P_V the embedding and LM head bytes: gradients, Adam's m and v and its sqrt(v)
    temporary are at most 4 copies live at once). Every phase's live bytes are ``c + a·P_V + s_V`` with ``a <= 4``,
    so the residual grows from V₁ to V₂ by at most the growth of the scoring's V-dependent tensors s_V:

    k3: ΔV · (8 · chunk + H) · 4 bytes = 28,672 · (8·64 + 64) · 4 = 66 MB;
    full KL: ΔV · (12 · chunk + H) · 4 bytes = 28,672 · (12·64 + 64) · 4 = 95 MB.
    One ``[B, L, V]`` float32 tensor, what the full KL's step held before it was chunked, grows by
    B·L·ΔV·4 = 2,048 · 28,672 · 4 = 235 MB: more than twice either bound, so the measurement tells them apart. The
    frozen reference's own embedding and LM head (P_V again, in float32 on the CPU) exist before the step."""
    work = Workload()
    small, large = (measure_vocab(v, tmp_path, work) for v in (4096, 32768))
    delta = large.vocab - small.vocab
    assert large.head_bytes - small.head_bytes == 2 * delta * HIDDEN * FLOAT  # untied embedding and head
    assert large.reference_head_bytes == large.head_bytes and small.reference_head_bytes == small.head_bytes
    k3_bound = delta * (CHUNK_TENSORS * work.chunk_tokens + HEAD_TEMPORARIES * HIDDEN) * FLOAT
    full_bound = delta * (FULL_KL_CHUNK_TENSORS * work.chunk_tokens + HEAD_TEMPORARIES * HIDDEN) * FLOAT
    dense_floor = work.tokens * delta * FLOAT
    assert k3_bound < full_bound < dense_floor / 2
    assert large.k3_residual - small.k3_residual <= k3_bound
    assert large.full_residual - small.full_residual <= full_bound

"""One training update's peak memory at two vocabulary sizes (:mod:`relax_services.bench.vocab_memory`): with the
sampled-token KL (k3) and with the exact full-vocabulary KL (``algorithm.kl_estimator=full``), only the embedding,
the LM head, their optimizer state and one chunk's tensors grow with V; the full KL's engine also holds the frozen
reference's weights, before and after the step alike."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def _train_peak_rss(tmp_path: Path, checkpoint: Path, data: Path, name: str) -> int:
    """Peak RSS in bytes of one colocated ``relax train`` of 2 updates, 2 groups of 2 samples of 256 new tokens,
    LM-head chunks of 64 tokens, no warm-up."""
    import subprocess
    import sys

    overrides = [
        f"model.source={checkpoint}",
        "run.mode=colocated",
        "run.progress=none",
        f"run.output_dir={tmp_path / 'runs'}",
        f"run.name={name}",
        f"data.train_files={data / 'train.jsonl'}",
        f"data.eval_files={data / 'eval.jsonl'}",
        "trainer.total_steps=2",
        "trainer.groups_per_step=2",
        "rollout.groups_per_call=2",
        "algorithm.group_size=2",
        f"rollout.max_new_tokens={NEW_TOKENS}",
        f"trainer.scoring_chunk_tokens={RUN_CHUNK}",
        "trainer.warmup_format_steps=0",
    ]
    # The colocated run is this one process: its own peak, read by itself as it ends.
    code = (
        "import resource, sys; from relax_services.cli import main; code = main(sys.argv[1:]); "
        "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss); sys.exit(code)"
    )
    done = subprocess.run([sys.executable, "-c", code, "train", *overrides], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    peak_kib = int(done.stdout.rsplit("PEAK_KIB", 1)[1].split()[0])
    return peak_kib * 1024


NEW_TOKENS = 256
RUN_CHUNK = 64
RUN_SAMPLES = 4
WEIGHT_COPIES = 18
"""``[V, H]`` matrices of the run that grow with V, with room: the Trainer's embedding and LM head with their
gradients, Adam's m and v and its update temporary (2 × 5), the k3 KL's Reference's two (2), the published version
(2, which the rollout and evaluation engines compute with in place), and the rollout's and evaluator's own initial
weights until their first load (2 × 2)."""


@pytest.mark.slow
def test_a_real_vocabulary_trains_two_updates_within_the_derived_memory(tmp_path: Path) -> None:
    """``relax train`` on a tiny model with Qwen's 151,936-row vocabulary against the same run at 4,096 rows: the
    peak RSS grows by at most ΔV · (CHUNK_TENSORS · chunk + WEIGHT_COPIES · H) · 4 bytes (each role's V-sized
    weights and one LM-head chunk's tensors), where holding the update's ``[tokens, V]`` logits, log-probs and their
    exp (what scoring did before the chunks) would alone add 3 · tokens · ΔV · 4 bytes, more than the bound.

    Measured on 2 loaded cores: 834 MB of growth against the 983 MB bound (1,816 MB for the dense tensors)."""
    import json

    from relax_services.models.tiny_families import write_tiny_checkpoint

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (data / "eval.jsonl").write_text(json.dumps(rows[0]) + "\n", encoding="utf-8")
    peaks = {}
    for vocab in (4096, 151936):
        folder = write_tiny_checkpoint(tmp_path / f"v{vocab}", "qwen2", 0, shape={"vocab_size": vocab})
        peaks[vocab] = _train_peak_rss(tmp_path, folder, data, f"v{vocab}")
    hidden = json.loads((tmp_path / "v4096" / "config.json").read_text(encoding="utf-8"))["hidden_size"]
    delta = 151936 - 4096
    bound = delta * (CHUNK_TENSORS * RUN_CHUNK + WEIGHT_COPIES * hidden) * FLOAT
    dense = 3 * RUN_SAMPLES * NEW_TOKENS * delta * FLOAT
    assert bound < dense  # the bound tells the chunked path from the dense one
    assert peaks[151936] - peaks[4096] <= bound, (peaks, bound)

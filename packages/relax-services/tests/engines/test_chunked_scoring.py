"""Chunked scoring (:func:`~relax_services.engines.scoring.token_scores`, and
:func:`~relax_services.engines.scoring.token_scores_with_kl` for the exact full-vocabulary KL) against the dense
``[B, L, V]`` formulas: values and gradients, and the memory it holds."""

from __future__ import annotations

import math

import pytest
import torch

from relax_core import kl_full
from relax_services.bench.peak_memory import peak_bytes
from relax_services.engines import score_responses
from relax_services.engines.scoring import token_scores, token_scores_with_kl
from relax_services.models import DEFAULT_SOURCE, build_tiny_omni, open_checkpoint
from relax_services.models.synthetic import synthetic_prompt

SUPPRESSED_IDS = open_checkpoint(DEFAULT_SOURCE).tokens.never_sample


def _dense(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    valid: torch.Tensor,
    temperature: float,
    suppressed: tuple[int, ...],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole-vocabulary formula, written out independently: ``z = h Wᵀ / T`` (suppressed ids −∞) shifted by its
    maximum (which changes neither; it keeps ``logsumexp z`` and ``Σ p z`` small, so their difference does not
    cancel), ``log p = z − logsumexp z``, entropy ``= logsumexp z − Σ p z``."""
    z = hidden @ weight.T / (temperature if temperature > 0 else 1.0)  # [B, L, V]
    support = torch.ones(weight.shape[0], dtype=torch.bool)
    support[list(suppressed)] = False
    z = z.masked_fill(~support, -math.inf)
    z = z - z.max(-1, keepdim=True).values.detach()
    lse = torch.logsumexp(z, -1)  # [B, L]
    logp = z - lse[..., None]
    token = logp.gather(-1, targets[..., None])[..., 0]
    entropy = lse - (logp.exp() * z.masked_fill(~support, 0.0)).sum(-1)
    zero = torch.zeros((), dtype=hidden.dtype)
    return torch.where(valid, token, zero), torch.where(valid, entropy, zero)


def _problem(dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random states of 3 rows × 7 positions (H = 16, V = 50) with holes in the mask, logits spread over a few
    units, and random weights on the log-probs and entropies so both get a gradient."""
    gen = torch.Generator().manual_seed(seed)
    b, length, h, v = 3, 7, 16, 50
    valid = torch.rand(b, length, generator=gen) < 0.75
    valid[0, 0] = True
    targets = torch.randint(0, v, (b, length), generator=gen)
    allowed = torch.tensor([i for i in range(v) if i not in (0, 7, 49)])
    targets = torch.where(valid, allowed[targets % len(allowed)], targets)  # masked positions may hold anything
    return {
        "hidden": torch.randn(b, length, h, generator=gen, dtype=dtype),
        "weight": torch.randn(v, h, generator=gen, dtype=dtype) * 3 / math.sqrt(h),
        "targets": targets,
        "valid": valid,
        "a": torch.randn(b, length, generator=gen, dtype=dtype),
        "b": torch.randn(b, length, generator=gen, dtype=dtype),
    }


SUPPRESSED = (0, 7, 49)


def _values_and_grads(
    p: dict[str, torch.Tensor], temperature: float, chunk: int | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy, d/d hidden, d/d weight)`` of ``Σ a·logprobs + b·entropy``, chunked (``chunk``) or dense
    (None)."""
    hidden = p["hidden"].clone().requires_grad_()
    head = torch.nn.Linear(hidden.shape[-1], p["weight"].shape[0], bias=False, dtype=hidden.dtype)
    with torch.no_grad():
        head.weight.copy_(p["weight"])
    if chunk is None:
        logp, entropy = _dense(hidden, head.weight, p["targets"], p["valid"], temperature, SUPPRESSED)
    else:
        logp, entropy = token_scores(head, hidden, p["targets"], p["valid"], temperature, SUPPRESSED, chunk)
    ((p["a"] * logp).sum() + (p["b"] * entropy).sum()).backward()
    assert hidden.grad is not None and head.weight.grad is not None
    return logp.detach(), entropy.detach(), hidden.grad, head.weight.grad


def _float64_tolerances(p: dict[str, torch.Tensor], temperature: float) -> tuple[float, float]:
    """``(values, gradients)`` tolerances from a first-order rounding analysis (Higham, *Accuracy and Stability of
    Numerical Algorithms*, §3.1: a sum of k rounded terms is within k·u of exact relative to the sum of the
    terms' magnitudes, u = eps / 2).

    Every quantity is a chain of at most K = H + V + N + 8 rounded operations (an H-term dot product per logit,
    V-term sums in the logsumexp and the entropy, an N-term sum per weight gradient, a few elementwise steps).
    With S = max Σ_i |h_i W_vi| / T bounding every |logit| and Λ = 2S + log V bounding |log p| on the support,
    a log-prob is within K·u·Λ of exact and an entropy (Σ p·log p, each term carrying the error of its log p
    into p and log p) within K·u·Λ(1 + Λ); so both within K·u·(1 + Λ)². The gradient of a·log p_t + b·H with
    respect to the logits sums, over the vocabulary, to at most 2A(1 + Λ) in magnitude (A = max |a|, |b|), with
    the same relative error; a state's gradient multiplies it by rows of W / T, a weight's sums it over N
    states / T. Each implementation is within its bound of exact, so the two within twice it."""
    u = torch.finfo(torch.float64).eps / 2
    n, (v, h) = int(p["valid"].sum()), p["weight"].shape
    t = temperature if temperature > 0 else 1.0
    s = float((p["hidden"].abs() @ p["weight"].abs().T).max()) / t
    lam = 2 * s + math.log(v)
    k = h + v + n + 8
    values = 2 * k * u * (1 + lam) ** 2
    coef = max(float(p["a"].abs().max()), float(p["b"].abs().max()))
    reach = max(float(p["weight"].abs().max()), n * float(p["hidden"].abs().max())) / t
    grads = 2 * k * u * (1 + lam) ** 2 * 2 * coef * reach
    return values, grads


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("chunk", [1, 4, 6, 18, 1000])  # n = 18 valid positions: 6 divides it, 4 does not
def test_chunked_equals_dense_in_float64(chunk: int, temperature: float) -> None:
    p = _problem(torch.float64)
    assert int(p["valid"].sum()) == 18  # the chunk sizes above are chosen around this count
    tol_values, tol_grads = _float64_tolerances(p, temperature)
    # Of the order of 1e-11 and 1e-8 here: far below any modelling error (a wrong temperature or support moves
    # values by > 1e-3), far above the ~1e-15 the two actually differ by.
    assert tol_values < 1e-9 and tol_grads < 1e-6
    got = _values_and_grads(p, temperature, chunk)
    want = _values_and_grads(p, temperature, None)
    for name, g, w in zip(("logprobs", "entropy"), got[:2], want[:2], strict=True):
        torch.testing.assert_close(g, w, atol=tol_values, rtol=0, msg=name)
    for name, g, w in zip(("d hidden", "d weight"), got[2:], want[2:], strict=True):
        torch.testing.assert_close(g, w, atol=tol_grads, rtol=0, msg=name)
    assert (got[0][~p["valid"]] == 0).all() and (got[1][~p["valid"]] == 0).all()
    assert (got[2][~p["valid"]] == 0).all()  # masked positions get no gradient


def test_chunked_equals_dense_in_float32() -> None:
    """The training dtype; torch's float32 defaults (rtol 1.3e-6, atol 1e-5): both sides compute each row with the
    same float32 operations except the LM head's and the weight gradient's summation order."""
    p = _problem(torch.float32, seed=1)
    got = _values_and_grads(p, 0.7, 5)
    want = _values_and_grads(p, 0.7, None)
    for name, g, w in zip(("logprobs", "entropy", "d hidden", "d weight"), got, want, strict=True):
        torch.testing.assert_close(g, w, msg=name)


def test_no_valid_position_still_gives_a_graph_and_a_bad_chunk_size_is_refused() -> None:
    p = _problem(torch.float32)
    hidden = p["hidden"].requires_grad_()
    head = torch.nn.Linear(16, 50, bias=False)
    logp, entropy = token_scores(head, hidden, p["targets"], torch.zeros_like(p["valid"]), 1.0, SUPPRESSED, 4)
    assert (logp == 0).all() and (entropy == 0).all()
    (logp.sum() + entropy.sum()).backward()  # a micro-batch of masked tokens only still back-propagates
    assert hidden.grad is not None and (hidden.grad == 0).all()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        token_scores(head, hidden, p["targets"], p["valid"], 1.0, SUPPRESSED, 0)


def _kl_values_and_grads(
    p: dict[str, torch.Tensor], r: dict[str, torch.Tensor], temperature: float, chunk: int | None
) -> tuple[torch.Tensor, ...]:
    """``(logprobs, entropy, full KL, d/d hidden, d/d weight)`` of ``Σ a·logprobs + b·entropy + c·KL`` with the
    policy ``p`` and the reference ``r`` (its states and head): chunked (``chunk``), or dense (None): the whole
    ``[B, L, V]`` log-probs of both (:func:`_dense`'s formula) and relax-core's :func:`kl_full` on them."""
    hidden = p["hidden"].clone().requires_grad_()
    head = torch.nn.Linear(hidden.shape[-1], p["weight"].shape[0], bias=False, dtype=hidden.dtype)
    ref_head = torch.nn.Linear(hidden.shape[-1], p["weight"].shape[0], bias=False, dtype=hidden.dtype)
    with torch.no_grad():
        head.weight.copy_(p["weight"])
        ref_head.weight.copy_(r["weight"])
    ref_head.requires_grad_(False)
    if chunk is None:
        logp, entropy = _dense(hidden, head.weight, p["targets"], p["valid"], temperature, SUPPRESSED)
        dist, ref_dist = (
            _dense_logprobs(h, w, temperature) for h, w in ((hidden, head.weight), (r["hidden"], r["weight"]))
        )
        kl = torch.where(p["valid"], kl_full(dist, ref_dist, clamp=None), 0.0)
    else:
        logp, entropy, kl = token_scores_with_kl(
            head, hidden, ref_head, r["hidden"], p["targets"], p["valid"], temperature, SUPPRESSED, chunk
        )
    ((p["a"] * logp).sum() + (p["b"] * entropy).sum() + (r["a"] * kl).sum()).backward()
    assert hidden.grad is not None and head.weight.grad is not None and ref_head.weight.grad is None
    return logp.detach(), entropy.detach(), kl.detach(), hidden.grad, head.weight.grad


def _dense_logprobs(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """``[B, L, V]`` log-probs ``z − logsumexp z`` of ``z = h Wᵀ / T`` with the suppressed ids at ``−inf``."""
    z = hidden @ weight.T / (temperature if temperature > 0 else 1.0)
    support = torch.ones(weight.shape[0], dtype=torch.bool)
    support[list(SUPPRESSED)] = False
    z = z.masked_fill(~support, -math.inf)
    return z - torch.logsumexp(z, -1, keepdim=True)


def _reference_problem(p: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """A reference of the same shapes: its own states and head (the policy has drifted from it), and random
    weights ``a`` on the per-token KL."""
    q = _problem(p["hidden"].dtype, seed)
    return {"hidden": q["hidden"], "weight": q["weight"], "a": q["a"]}


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 6, 1000])  # n = 18 valid positions: 6 divides it, 4 does not
def test_chunked_full_kl_equals_relax_core_kl_full_on_the_dense_distributions(chunk: int, temperature: float) -> None:
    """The per-token KL(π_ref ‖ π) of the chunks against :func:`kl_full` on both whole ``[B, L, V]`` log-prob
    tensors (the suppressed ids ``−inf`` in both: off the support), values and gradients w.r.t. the policy's states
    and LM head, in float64. The KL is ``Σ_v π_ref (log π_ref − log π)``: each log-prob is within the bound of
    :func:`_float64_tolerances` (of the policy's or the reference's logits, the larger), the sum of V terms of
    probability-weighted errors stays within it (Σ π_ref = 1), and its gradient w.r.t. the logits is
    ``c (π − π_ref)``, of total magnitude at most 2|c|: the gradients' bound of the same analysis, for two terms
    (``a``, ``b``), doubled for three (``c`` among the coefficients)."""
    p = _problem(torch.float64)
    r = _reference_problem(p, seed=5)
    tol_values, tol_grads = (
        max(a, b)
        for a, b in zip(
            _float64_tolerances({**p, "a": r["a"]}, temperature),
            _float64_tolerances({**r, "valid": p["valid"], "b": p["b"]}, temperature),
            strict=True,
        )
    )
    tol_grads *= 2
    assert tol_values < 1e-9 and tol_grads < 1e-6
    got = _kl_values_and_grads(p, r, temperature, chunk)
    want = _kl_values_and_grads(p, r, temperature, None)
    assert float(want[2][p["valid"]].min()) > 0.05  # the policy is away from the reference at every position
    for name, g, w in zip(("logprobs", "entropy", "full KL"), got[:3], want[:3], strict=True):
        torch.testing.assert_close(g, w, atol=tol_values, rtol=0, msg=name)
    for name, g, w in zip(("d hidden", "d weight"), got[3:], want[3:], strict=True):
        torch.testing.assert_close(g, w, atol=tol_grads, rtol=0, msg=name)
    assert (got[2][~p["valid"]] == 0).all() and (got[3][~p["valid"]] == 0).all()


def test_chunked_full_kl_equals_kl_full_in_float32() -> None:
    """The training dtype with torch's float32 defaults (rtol 1.3e-6, atol 1e-5), as for the log-probs above: the
    same float32 operations on each row except the LM heads' summation order."""
    p = _problem(torch.float32, seed=2)
    r = _reference_problem(p, seed=3)
    got = _kl_values_and_grads(p, r, 0.7, 5)
    want = _kl_values_and_grads(p, r, 0.7, None)
    for name, g, w in zip(("logprobs", "entropy", "full KL", "d hidden", "d weight"), got, want, strict=True):
        torch.testing.assert_close(g, w, msg=name)


def test_chunked_full_kl_is_zero_against_the_policy_itself() -> None:
    """Hand value: the policy as its own reference has KL 0 at every position, and a zero gradient (π − π_ref = 0);
    the suppressed ids, ``−inf`` on both sides, add nothing (not NaN)."""
    p = _problem(torch.float64)
    head = torch.nn.Linear(16, 50, bias=False, dtype=torch.float64)
    with torch.no_grad():
        head.weight.copy_(p["weight"])
    hidden = p["hidden"].clone().requires_grad_()
    _, _, kl = token_scores_with_kl(head, hidden, head, p["hidden"], p["targets"], p["valid"], 1.0, SUPPRESSED, 4)
    assert kl.abs().max() < 1e-12
    kl.sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().max() < 1e-12


def _samples(seed: int = 0) -> tuple[list, list[torch.Tensor]]:
    """Mixed-modality prompts (the first one twice, as in a group) and responses of different lengths; the
    last token of the third is a suppressed id (masked out of the scores)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [synthetic_prompt(kind, [12, 48], gen) for kind in ("image", "audio", "text", "video")]
    prompts.insert(1, prompts[0])
    responses = [torch.randint(12, 48, (3 + 2 * i,), generator=gen) for i in range(len(prompts))]
    responses[2][-1] = SUPPRESSED_IDS[-1]
    return prompts, responses


def _score_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_score_responses_equals_the_dense_formula_of_plain_forwards() -> None:
    """``score_responses`` (chunks of 3 tokens) against the dense formula on one unpadded forward of the tiny
    thinker per sample (the repository's reference for the shared-prompt scoring), values and gradients."""
    temperature = 0.7
    prompts, responses = _samples()
    model = build_tiny_omni(0)
    gen = torch.Generator().manual_seed(1)
    coef_a = [torch.randn(len(r), generator=gen) for r in responses]
    coef_b = [torch.randn(len(r), generator=gen) for r in responses]
    weight_a = torch.nn.utils.rnn.pad_sequence(coef_a, batch_first=True)  # [B, L]
    weight_b = torch.nn.utils.rnn.pad_sequence(coef_b, batch_first=True)

    def objective(logp: torch.Tensor, entropy: torch.Tensor) -> torch.Tensor:
        return (weight_a * logp).sum() + (weight_b * entropy).sum()

    chunked = score_responses(model, prompts, responses, temperature, SUPPRESSED_IDS, chunk_tokens=3)
    assert chunked.full_kl is None  # no reference: no KL
    objective(chunked.logprobs, chunked.entropy).backward()
    grads_chunked = _score_grads(model)

    allowed = torch.tensor([i not in SUPPRESSED_IDS for i in range(64)])
    total = torch.zeros(())
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        ids = torch.cat([prompt.input_ids, response[:-1]])[None]  # the last token (a suppressed id in one) predicts
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **prompt.media()).logits[0]  # nothing
        logits = logits[prompt.num_tokens - 1 :] / temperature  # [L_i, V] predicting each response token
        logp_all = torch.log_softmax(logits.masked_fill(~allowed, -math.inf), -1)
        token = logp_all.gather(-1, response[:, None])[:, 0]
        entropy = -(logp_all.exp() * logp_all.masked_fill(torch.isinf(logp_all), 0.0)).sum(-1)
        kept = allowed[response]
        n = len(response)
        assert torch.equal(chunked.mask[i, :n].bool(), kept) and not chunked.mask[i, n:].any()
        torch.testing.assert_close(chunked.logprobs[i, :n], torch.where(kept, token, 0.0), atol=1e-5, rtol=0)
        torch.testing.assert_close(chunked.entropy[i, :n], torch.where(kept, entropy, 0.0), atol=1e-5, rtol=0)
        total = total + (coef_a[i] * token)[kept].sum() + (coef_b[i] * entropy)[kept].sum()
    total.backward()
    grads_plain = _score_grads(model)

    assert grads_chunked.keys() == grads_plain.keys()
    for name, g in grads_chunked.items():
        torch.testing.assert_close(g, grads_plain[name], atol=1e-5, rtol=1e-4, msg=name)


def test_chunked_forward_and_backward_hold_one_chunk_of_the_vocabulary_at_a_time() -> None:
    """Exact, not a machine's luck: the profiler records every allocation and free of torch's CPU allocator, so the
    peak is a count of tensor bytes, the same on any machine for the same operations.

    N = 512 tokens in chunks of C = 8 at V = 2,048: the dense formula's one [N, V] float32 tensor is 4 MiB, 64
    chunks' worth. The chunked forward + backward (recomputing each chunk) holds a few [C, V] tensors (logits,
    log-probs, their exp and gradients) and the [V, H] weight gradient (H < C); the bound allows 8 chunks' worth
    plus the V-independent [N, H] and [N] tensors with room (0.66 MiB; measured: 0.39 MiB), so one whole [N, V]
    tensor (4 MiB) exceeds it, and so do the activations of every chunk saved for the backward (measured with the
    recomputation switched off: 13 MiB)."""
    n_tokens, chunk, vocab, width = 512, 8, 2048, 4
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, n_tokens // 2, width, generator=gen).requires_grad_()
    head = torch.nn.Linear(width, vocab, bias=False)
    targets = torch.randint(8, vocab, (2, n_tokens // 2), generator=gen)
    valid = torch.ones(2, n_tokens // 2, dtype=torch.bool)

    def chunked() -> None:
        logp, entropy = token_scores(head, hidden, targets, valid, 0.7, SUPPRESSED, chunk)
        (logp.sum() + entropy.sum()).backward()

    def dense() -> None:
        logp, entropy = _dense(hidden, head.weight, targets, valid, 0.7, SUPPRESSED)
        (logp.sum() + entropy.sum()).backward()

    one_chunk = chunk * vocab * 4
    bound = 8 * one_chunk + 16 * n_tokens * (width + 1) * 4
    assert bound < n_tokens * vocab * 4 / 4  # a quarter of one [N, V] float32 tensor
    assert peak_bytes(chunked) <= bound
    assert peak_bytes(dense) >= n_tokens * vocab * 4  # the same measurement sees the whole tensor


def test_chunked_full_kl_holds_a_few_chunks_of_the_vocabulary_at_a_time() -> None:
    """As above with the reference (its states and frozen head): N = 512 tokens in chunks of C = 8 at V = 2,048.
    A recomputed chunk holds k3's tensors and the reference's ``[C, V]`` log-probs, the support mask, the clamped
    log-probs, the log-ratio, the reference's probabilities and their product, and the gradients through them:
    fewer than 12 chunks' worth at once (measured with the V-independent tensors: 7.6), within a quarter of one
    ``[N, V]`` float32 tensor, which the dense formula holds several of."""
    n_tokens, chunk, vocab, width = 512, 8, 2048, 4
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, n_tokens // 2, width, generator=gen).requires_grad_()
    ref_hidden = torch.randn(2, n_tokens // 2, width, generator=gen)
    head = torch.nn.Linear(width, vocab, bias=False)
    ref_head = torch.nn.Linear(width, vocab, bias=False).requires_grad_(False)
    targets = torch.randint(8, vocab, (2, n_tokens // 2), generator=gen)
    valid = torch.ones(2, n_tokens // 2, dtype=torch.bool)

    def chunked() -> None:
        logp, entropy, kl = token_scores_with_kl(
            head, hidden, ref_head, ref_hidden, targets, valid, 0.7, SUPPRESSED, chunk
        )
        (logp.sum() + entropy.sum() + kl.sum()).backward()

    def dense() -> None:
        dist = _dense_logprobs(hidden, head.weight, 0.7)
        with torch.no_grad():
            ref_dist = _dense_logprobs(ref_hidden, ref_head.weight, 0.7)
        kl_full(dist, ref_dist, clamp=None).sum().backward()

    bound = 12 * chunk * vocab * 4 + 16 * n_tokens * (width + 1) * 4
    assert bound < n_tokens * vocab * 4 / 4
    assert peak_bytes(chunked) <= bound
    assert peak_bytes(dense) >= 2 * n_tokens * vocab * 4  # both distributions, whole

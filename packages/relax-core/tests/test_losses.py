"""Policy/value losses, corrections and KL against hand-computed values and the issue's properties."""

from __future__ import annotations

import math

import pytest
import torch

import relax_core as rc


def _batch(seed: int = 0, b: int = 3, t: int = 5) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=gen) * 2
    logp = old + 0.3 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, t, generator=gen)
    mask = torch.ones(b, t)
    mask[0, t // 2 :] = 0
    mask[b - 1, 1] = 0
    return logp, old, adv, mask


def _loss_and_grad(cfg: rc.AlgorithmConfig, logp: torch.Tensor, *args: torch.Tensor, **kwargs: torch.Tensor):
    leaf = logp.clone().requires_grad_()
    loss, diag = rc.compute_policy_loss(cfg, leaf, *args, **kwargs)
    loss.backward()
    assert leaf.grad is not None
    return loss.detach(), leaf.grad, diag


ALL_LOSSES = ["ppo", "gspo", "cispo", "sapo"]


def test_ppo_ratio_one_gives_minus_mean_advantage() -> None:
    _, old, adv, mask = _batch()
    loss, grad, diag = _loss_and_grad(rc.AlgorithmConfig(), old, old, adv, mask)
    expected = -(adv * mask).sum() / mask.sum()
    torch.testing.assert_close(loss, expected)
    # d loss / d logp = −A / N on valid tokens at ratio 1
    torch.testing.assert_close(grad, -adv * mask / mask.sum())
    assert diag["clip_frac"] == 0.0 and diag["approx_kl"] == pytest.approx(0.0, abs=1e-7)
    assert diag["ratio_mean"] == pytest.approx(1.0)


def test_ppo_clip_hand_values() -> None:
    log_ratio = torch.log(torch.tensor([[1.5, 0.5, 1.1, 5.0, 0.5]]))
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0, 1.0]])
    loss, clipped, dual = rc.ppo_clip_loss(log_ratio, adv, 0.2, 0.28, dual_clip_c=3.0)
    # r=1.5,A=1 → −1.28 (clip-higher); r=0.5,A=−1 → max(0.5, 0.8) = 0.8; r=1.1,A=2 → −2.2;
    # r=5,A=−1 → max(5, 1.28) = 5, dual clip caps at 3; r=0.5,A=1 → max(−0.5, −0.8) = −0.5
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8, -2.2, 3.0, -0.5]]))
    assert clipped.tolist() == [[True, True, False, False, False]]
    assert dual.tolist() == [[False, False, False, True, False]]


def test_ppo_clipped_tokens_have_zero_gradient() -> None:
    log_ratio = torch.log(torch.tensor([1.5, 0.5, 1.1])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, _, _ = rc.ppo_clip_loss(log_ratio, adv, 0.2, 0.2)
    loss.sum().backward()
    assert log_ratio.grad is not None
    torch.testing.assert_close(log_ratio.grad, torch.tensor([0.0, 0.0, -2.2]))


@pytest.mark.parametrize("policy_loss", ALL_LOSSES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_masked_tokens_get_exactly_zero_gradient(policy_loss: str, agg: str) -> None:
    logp, old, adv, mask = _batch(1)
    # Garbage in the padding must not leak: −inf log-probs and NaN advantages where mask = 0.
    logp = torch.where(mask.bool(), logp, torch.tensor(-math.inf))
    adv = torch.where(mask.bool(), adv, torch.tensor(math.nan))
    cfg = rc.AlgorithmConfig(policy_loss=policy_loss, loss_agg_mode=agg, kl_coef=0.1, entropy_coef=0.01)
    entropy = torch.rand_like(logp)
    ref = old - 0.1
    leaf = logp.clone().requires_grad_()
    loss, _ = rc.compute_policy_loss(cfg, leaf, old, adv, mask, ref_logprobs=ref, entropy=entropy)
    loss.backward()
    assert leaf.grad is not None and torch.isfinite(loss)
    assert torch.all(leaf.grad[~mask.bool()] == 0.0)
    assert torch.all(torch.isfinite(leaf.grad))
    assert leaf.grad[mask.bool()].abs().sum() > 0


@pytest.mark.parametrize("preset", ["grpo", "dapo", "gspo", "dr_grpo", "ppo"])
def test_decoupled_with_equal_behaviour_and_proximal_equals_ppo(preset: str) -> None:
    logp, old, adv, mask = _batch(2)
    plain = rc.load_preset(preset, {"kl_coef": 0.0})
    decoupled = rc.load_preset(preset, {"kl_coef": 0.0, "decoupled": True, "tis_cap": 2.0, "mis_level": "token"})
    loss_a, grad_a, _ = _loss_and_grad(plain, logp, old, adv, mask)
    loss_b, grad_b, diag = _loss_and_grad(decoupled, logp, old, adv, mask, proximal_logprobs=old.clone())
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(grad_a, grad_b)
    assert diag["is_weight_mean"] == pytest.approx(1.0) and diag["mismatch_kl"] == pytest.approx(0.0, abs=1e-7)
    assert diag["is_masked_frac"] == 0.0 and diag["is_truncated_frac"] == 0.0


def test_decoupled_ppo_hand_values() -> None:
    # One token: behaviour log μ = log 0.5, proximal log π_prox = log 0.6, current log π_θ = log 0.9.
    # w = 0.6/0.5 = 1.2, r = 0.9/0.6 = 1.5 clipped to 1.2 for A = 1 → loss = −1.2·1.2 = −1.44.
    behaviour, prox, cur = (torch.log(torch.tensor([[x]])) for x in (0.5, 0.6, 0.9))
    cfg = rc.AlgorithmConfig(decoupled=True)
    loss, _, diag = _loss_and_grad(cfg, cur, behaviour, torch.ones(1, 1), torch.ones(1, 1), proximal_logprobs=prox)
    assert loss.item() == pytest.approx(-1.44, rel=1e-5)
    assert diag["clip_frac"] == 1.0
    # With TIS cap 1.1 the weight is truncated: −1.1·1.2 = −1.32.
    capped = rc.AlgorithmConfig(decoupled=True, tis_cap=1.1)
    loss, _, diag = _loss_and_grad(capped, cur, behaviour, torch.ones(1, 1), torch.ones(1, 1), proximal_logprobs=prox)
    assert loss.item() == pytest.approx(-1.32, rel=1e-5)
    assert diag["is_truncated_frac"] == 1.0 and diag["is_weight_max"] == pytest.approx(1.2, rel=1e-5)
    # mismatch KL(μ ‖ π_prox) by k3 with log w = log 1.2: w − 1 − log w
    assert diag["mismatch_kl"] == pytest.approx(0.2 - math.log(1.2), rel=1e-4)


def test_masked_is_token_and_sequence_levels() -> None:
    behaviour = torch.zeros(2, 3)
    prox = torch.log(torch.tensor([[1.0, 3.0, 1.0], [1.0, 1.0, 1.0]]))
    mask = torch.ones(2, 3)
    token = rc.importance_weights(prox, behaviour, mask, mis_level="token", mis_low=0.5, mis_high=2.0)
    assert token.keep.tolist() == [[True, False, True], [True, True, True]]
    # Sequence 0: geometric mean ratio 3^(1/3) = 1.44 ∈ [0.5, 2] → kept; with mis_high 1.4 → rejected.
    seq = rc.importance_weights(prox, behaviour, mask, mis_level="sequence", mis_low=0.5, mis_high=1.4)
    assert seq.keep.tolist() == [[False, False, False], [True, True, True]]
    seq_ok = rc.importance_weights(prox, behaviour, mask, mis_level="sequence", mis_low=0.5, mis_high=2.0)
    assert bool(seq_ok.keep.all())


def test_masked_is_drops_rejected_tokens_from_the_loss() -> None:
    behaviour = torch.zeros(1, 2)
    prox = torch.log(torch.tensor([[1.0, 3.0]]))
    adv = torch.tensor([[1.0, 5.0]])
    cfg = rc.AlgorithmConfig(decoupled=True, mis_level="token")
    loss, grad, diag = _loss_and_grad(cfg, prox, behaviour, adv, torch.ones(1, 2), proximal_logprobs=prox)
    # Only token 0 remains (ratio 1, weight 1): loss = −1, and token 1 gets no gradient.
    assert loss.item() == pytest.approx(-1.0)
    assert grad[0, 1] == 0.0
    assert diag["is_masked_frac"] == 0.5


def test_gspo_on_one_token_sequences_equals_ppo() -> None:
    gen = torch.Generator().manual_seed(4)
    old = -torch.rand(6, 1, generator=gen)
    logp = old + 0.4 * torch.randn(6, 1, generator=gen)
    adv = torch.randn(6, 1, generator=gen)
    mask = torch.ones(6, 1)
    ppo = rc.AlgorithmConfig(policy_loss="ppo", clip_eps_low=0.1, clip_eps_high=0.15)
    gspo = rc.AlgorithmConfig(policy_loss="gspo", clip_eps_low=0.1, clip_eps_high=0.15)
    loss_a, grad_a, _ = _loss_and_grad(ppo, logp, old, adv, mask)
    loss_b, grad_b, _ = _loss_and_grad(gspo, logp, old, adv, mask)
    torch.testing.assert_close(loss_a, loss_b)
    torch.testing.assert_close(grad_a, grad_b)


def test_gspo_matches_sequence_objective() -> None:
    # Independent GSPO (Zheng et al. 2025, eq. 5): −mean_i min(s_i A_i, clip(s_i) A_i) with
    # s_i = exp(mean_t log r_{i,t}), computed per sequence with autograd.
    gen = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 4, generator=gen)
    logp = old + 0.05 * torch.randn(3, 4, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.float32)
    seq_adv = torch.tensor([1.0, -0.5, 2.0])
    cfg = rc.AlgorithmConfig(
        policy_loss="gspo", clip_eps_low=0.03, clip_eps_high=0.04, loss_agg_mode="seq-mean-token-mean"
    )
    loss, grad, _ = _loss_and_grad(cfg, logp, old, seq_adv[:, None].expand(3, 4), mask)

    leaf = logp.clone().requires_grad_()
    terms = []
    for i in range(3):
        valid = mask[i].bool()
        s = torch.exp((leaf[i][valid] - old[i][valid]).mean())
        terms.append(-torch.minimum(s * seq_adv[i], torch.clamp(s, 0.97, 1.04) * seq_adv[i]))
    ref = torch.stack(terms).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref.detach())
    assert leaf.grad is not None
    torch.testing.assert_close(grad, leaf.grad)


def test_cispo_value_and_gradient() -> None:
    log_ratio = torch.log(torch.tensor([0.5, 1.0, 2.0])).requires_grad_()
    adv = torch.tensor([1.0, -2.0, 3.0])
    loss, clipped = rc.cispo_loss(log_ratio, adv, clip_eps_low=0.2, clip_eps_high=0.28)
    # weights clip(r) = (0.8, 1.0, 1.28); value −w·A; gradient w.r.t. log π is −w·A (no token dropped)
    torch.testing.assert_close(loss.detach(), torch.tensor([-0.8, 2.0, -3.84]))
    loss.sum().backward()
    assert log_ratio.grad is not None
    torch.testing.assert_close(log_ratio.grad, torch.tensor([-0.8, 2.0, -3.84]))
    assert clipped.tolist() == [True, False, True]


def test_sapo_value_and_gradient() -> None:
    ratio = torch.tensor([1.0, 1.5, 0.7])
    adv = torch.tensor([1.0, 2.0, -1.0])
    log_ratio = torch.log(ratio).requires_grad_()
    loss, _ = rc.sapo_loss(log_ratio, adv, tau_pos=1.0, tau_neg=1.05)
    tau = torch.tensor([1.0, 1.0, 1.05])
    sig = torch.sigmoid(tau * (ratio - 1))
    torch.testing.assert_close(loss.detach(), -(4 / tau) * sig * adv)
    loss.sum().backward()
    # d/dlog r of −(4/τ) σ(τ(r−1)) A = −4 σ (1 − σ) r A; equals −A at r = 1 (the policy gradient)
    assert log_ratio.grad is not None
    torch.testing.assert_close(log_ratio.grad, -4 * sig * (1 - sig) * ratio * adv)
    assert log_ratio.grad[0].item() == pytest.approx(-1.0)


def test_aggregation_modes_hand_values() -> None:
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert rc.aggregate_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert rc.aggregate_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert rc.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert rc.aggregate_loss(loss, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))
    assert rc.aggregate_loss(loss, mask, "seq-mean-token-sum-norm", 10).item() == pytest.approx(10 / 20)
    # A sequence with no valid tokens does not dilute seq-mean-token-mean
    empty = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert rc.aggregate_loss(loss, empty, "seq-mean-token-mean").item() == pytest.approx(2.0)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        rc.aggregate_loss(loss, mask, "bogus")  # type: ignore[arg-type]


def test_kl_estimators_hand_values() -> None:
    logp = torch.tensor([math.log(0.5)])
    ref = torch.tensor([math.log(0.25)])
    log_r = math.log(0.5)  # log π_ref − log π_θ
    assert rc.kl_estimate(logp, ref, "k1").item() == pytest.approx(-log_r)
    assert rc.kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * log_r**2)
    assert rc.kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - 1 - log_r)
    # Clamp: an extreme token contributes at most `clamp`
    far = rc.kl_estimate(torch.tensor([-30.0]), torch.tensor([0.0]), "k3", clamp=10.0)
    assert far.item() == 10.0
    with pytest.raises(ValueError, match="k1, k2, k3"):
        rc.kl_estimate(logp, ref, "k4")  # type: ignore[arg-type]


def test_k3_is_unbiased_estimate_of_kl() -> None:
    # Two categorical distributions; E_{x∼π}[k3] must equal the exact KL(π ‖ π_ref).
    pi = torch.tensor([0.6, 0.3, 0.1])
    ref = torch.tensor([0.2, 0.5, 0.3])
    exact = (pi * (pi / ref).log()).sum()
    per_x = rc.kl_estimate(pi.log(), ref.log(), "k3", clamp=None)
    torch.testing.assert_close((pi * per_x).sum(), exact)
    per_x_k1 = rc.kl_estimate(pi.log(), ref.log(), "k1", clamp=None)
    torch.testing.assert_close((pi * per_x_k1).sum(), exact)


def test_full_kl_hand_values_and_it_raises_an_option_the_policy_stopped_sampling() -> None:
    # Vocabulary of 4; the last id is outside both supports (suppressed).
    ref = torch.tensor([0.5, 0.5, 0.0, 0.0]).log()  # the reference: two options, evenly
    pi = torch.tensor([0.98, 1e-6, 0.02 - 1e-6, 0.0]).log()  # collapsed onto option 0
    exact = 0.5 * math.log(0.5 / 0.98) + 0.5 * math.log(0.5 / 1e-6)  # Σ ref · (log ref − log π)
    kl = rc.kl_full(pi.view(1, 1, 4), ref.view(1, 1, 4), clamp=None)
    assert kl.shape == (1, 1)
    assert kl.item() == pytest.approx(exact, rel=1e-5)
    assert rc.kl_full(pi.view(1, 1, 4), ref.view(1, 1, 4), clamp=3.0).item() == 3.0
    # Gradient w.r.t. the logits is π − π_ref: descent raises option 1, which a sampled estimate never sees.
    logits = pi.clone().requires_grad_()
    rc.kl_full(torch.log_softmax(logits, -1).view(1, 1, 4), ref.view(1, 1, 4), clamp=None).sum().backward()
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, pi.exp() - ref.exp(), atol=1e-6, rtol=0)
    assert logits.grad[1] < -0.49  # minus the gradient: option 1's logit goes up
    # The sampled k3 of the only token the policy samples has no such term.
    k3_logit = pi.clone().requires_grad_()
    token = torch.log_softmax(k3_logit, -1)[0].view(1)
    rc.kl_estimate(token, ref[0].view(1), "k3").sum().backward()
    assert k3_logit.grad is not None and abs(float(k3_logit.grad[1])) < 1e-5
    with pytest.raises(ValueError, match="kl_full"):
        rc.kl_estimate(pi, ref, "full")
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        rc.kl_full(pi, ref)


def test_full_kl_in_the_loss() -> None:
    """The loss takes the per-token KL unclamped (a training engine sums it over chunks of the vocabulary) and clamps
    it with ``kl_clamp`` as :func:`kl_full` does; its gradient reaches the policy's distribution through it."""
    logp, old, adv, mask = _batch(8, b=2, t=3)
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 3, 5, generator=gen).requires_grad_()
    dist = torch.log_softmax(logits, -1)
    ref_dist = torch.log_softmax(torch.randn(2, 3, 5, generator=gen), -1)
    cfg = rc.AlgorithmConfig(kl_coef=0.5, kl_estimator="full")
    loss0, _ = rc.compute_policy_loss(rc.AlgorithmConfig(), logp, old, adv, mask)
    per_position = (ref_dist.exp() * (ref_dist - dist)).sum(-1)  # [2, 3], written out
    loss1, diag = rc.compute_policy_loss(cfg, logp, old, adv, mask, full_kl=rc.kl_full(dist, ref_dist, clamp=None))
    torch.testing.assert_close(loss1, loss0 + 0.5 * rc.masked_mean(per_position, mask))
    assert diag["kl"] == pytest.approx(rc.masked_mean(per_position, mask).item(), rel=1e-5)
    (loss1 - loss0).backward()
    assert logits.grad is not None
    # d/dz of 0.5 · masked mean of KL(ref ‖ softmax z) is 0.5 · (π − π_ref) / n on each kept position.
    expected = 0.5 * (dist.exp() - ref_dist.exp()) * mask[..., None] / mask.sum()
    torch.testing.assert_close(logits.grad, expected.detach())
    # The clamp is kl_full's: a per-token value above kl_clamp counts as kl_clamp.
    clamped = rc.AlgorithmConfig(kl_coef=0.5, kl_estimator="full", kl_clamp=0.1)
    _, diag = rc.compute_policy_loss(clamped, logp, old, adv, mask, full_kl=per_position.detach())
    want = rc.masked_mean(rc.kl_full(dist, ref_dist, clamp=0.1), mask).item()
    assert diag["kl"] == pytest.approx(want, rel=1e-6) and want < rc.masked_mean(per_position, mask).item()
    with pytest.raises(ValueError, match="full_kl"):
        rc.compute_policy_loss(cfg, logp, old, adv, mask, ref_logprobs=old)
    with pytest.raises(ValueError, match="full_kl has shape"):
        rc.compute_policy_loss(cfg, logp, old, adv, mask, full_kl=per_position[:, :2])
    with pytest.raises(ValueError, match="kl_placement"):
        rc.AlgorithmConfig(kl_coef=0.5, kl_estimator="full", kl_placement="reward")


def test_kl_in_loss_and_kl_penalised_rewards() -> None:
    logp, old, adv, mask = _batch(6)
    ref = old - 0.2
    base = rc.AlgorithmConfig(kl_coef=0.0)
    with_kl = rc.AlgorithmConfig(kl_coef=0.5, kl_estimator="k2")
    loss0, _ = rc.compute_policy_loss(base, logp, old, adv, mask)
    loss1, diag = rc.compute_policy_loss(with_kl, logp, old, adv, mask, ref_logprobs=ref)
    kl = rc.masked_mean(0.5 * (ref - logp) ** 2, mask)
    torch.testing.assert_close(loss1, loss0 + 0.5 * kl)
    assert diag["kl"] == pytest.approx(kl.item(), rel=1e-5)
    # Placement "reward": reported, not added
    in_reward = rc.AlgorithmConfig(kl_coef=0.5, kl_placement="reward")
    loss2, diag2 = rc.compute_policy_loss(in_reward, logp, old, adv, mask, ref_logprobs=ref)
    torch.testing.assert_close(loss2, loss0)
    assert "kl" in diag2
    rewards = rc.kl_penalised_rewards(
        torch.ones(1, 2), torch.zeros(1, 2), torch.full((1, 2), -0.5), torch.tensor([[1, 0]]), 0.1
    )
    torch.testing.assert_close(rewards, torch.tensor([[1 - 0.05, 1.0]]))


def test_entropy_bonus_and_entropy_from_logits() -> None:
    logits = torch.randn(2, 3, 7, generator=torch.Generator().manual_seed(7))
    expected = torch.distributions.Categorical(logits=logits).entropy()
    torch.testing.assert_close(rc.entropy_from_logits(logits), expected)
    logp, old, adv, mask = _batch(7, b=2, t=3)
    loss0, _ = rc.compute_policy_loss(rc.AlgorithmConfig(), logp, old, adv, mask)
    loss1, diag = rc.compute_policy_loss(rc.AlgorithmConfig(entropy_coef=0.1), logp, old, adv, mask, entropy=expected)
    ent = rc.masked_mean(expected, mask)
    torch.testing.assert_close(loss1, loss0 - 0.1 * ent)
    assert diag["entropy"] == pytest.approx(ent.item(), rel=1e-5)


def test_value_loss_hand_values() -> None:
    values = torch.tensor([[1.0, 0.0, 5.0]])
    old = torch.tensor([[0.5, 0.0, 0.0]])
    returns = torch.tensor([[2.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, diag = rc.value_loss(values, old, returns, mask, clip_eps=0.2)
    # token 0: unclipped (1−2)² = 1, clipped V = 0.7 → (0.7−2)² = 1.69 → 0.845
    # token 1: unclipped 1, clipped V = 0 → 1 → 0.5; mean = 0.6725
    assert loss.item() == pytest.approx((0.845 + 0.5) / 2)
    assert diag["vf_clipfrac"] == pytest.approx(0.5)
    unclipped, _ = rc.value_loss(values, old, returns, mask, clip_eps=None)
    assert unclipped.item() == pytest.approx(0.5)


def test_diagnostics_keys() -> None:
    logp, old, adv, mask = _batch(8)
    cfg = rc.AlgorithmConfig(decoupled=True, tis_cap=2.0)
    _, diag = rc.compute_policy_loss(cfg, logp, old, adv, mask, proximal_logprobs=old + 0.01, ref_logprobs=old)
    expected = {
        "policy_loss", "loss", "clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean", "kl",
        "is_weight_mean", "is_weight_min", "is_weight_max", "is_truncated_frac", "is_masked_frac", "mismatch_kl",
    }  # fmt: skip
    assert expected <= set(diag)
    assert all(isinstance(v, float) and math.isfinite(v) for v in diag.values())


def test_approx_kl_is_k3_of_anchor_to_current() -> None:
    old = torch.log(torch.tensor([[0.5, 0.25]]))
    cur = torch.log(torch.tensor([[0.25, 0.5]]))
    _, diag = rc.compute_policy_loss(rc.AlgorithmConfig(), cur, old, torch.zeros(1, 2), torch.ones(1, 2))
    lr = [math.log(0.5), math.log(2.0)]
    assert diag["approx_kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in lr) / 2, rel=1e-5)


def test_compute_policy_loss_input_errors() -> None:
    logp, old, adv, mask = _batch(9)
    with pytest.raises(ValueError, match="advantages has shape"):
        rc.compute_policy_loss(rc.AlgorithmConfig(), logp, old, adv[:, :2], mask)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        rc.compute_policy_loss(rc.AlgorithmConfig(decoupled=True), logp, old, adv, mask)
    with pytest.raises(ValueError, match="decoupled is false"):
        rc.compute_policy_loss(rc.AlgorithmConfig(), logp, old, adv, mask, proximal_logprobs=old)
    with pytest.raises(ValueError, match="ref_logprobs"):
        rc.compute_policy_loss(rc.AlgorithmConfig(kl_coef=0.1), logp, old, adv, mask)
    with pytest.raises(ValueError, match="entropy"):
        rc.compute_policy_loss(rc.AlgorithmConfig(entropy_coef=0.1), logp, old, adv, mask)


def test_value_loss_masked_tokens_get_zero_gradient() -> None:
    values = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    old = torch.tensor([[0.5, math.nan, 0.0]])
    returns = torch.tensor([[2.0, math.inf, 0.0]])
    mask = torch.tensor([[1, 0, 1]])
    loss, _ = rc.value_loss(values, old, returns, mask, clip_eps=0.2)
    loss.backward()
    assert values.grad is not None and torch.isfinite(loss)
    assert values.grad[0, 1] == 0.0 and torch.all(torch.isfinite(values.grad))


def test_token_logprobs_matches_log_softmax_gather() -> None:
    logits = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    ids = torch.tensor([[0, 5, 2, 3], [1, 1, 4, 0]])
    expected = torch.tensor(
        [[math.log(torch.softmax(logits[b, t], -1)[ids[b, t]].item()) for t in range(4)] for b in range(2)],
        dtype=torch.float32,
    )
    torch.testing.assert_close(rc.token_logprobs(logits, ids), expected)


def test_seq_mean_token_sum_leaves_out_sequences_with_no_valid_token() -> None:
    # Row 0 sums to 1 + 2 + 3 = 6; row 1 has no valid token, so the mean over sequences is 6 / 1.
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    assert rc.aggregate_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx(6.0)
    # Nothing valid at all: zero, not NaN.
    assert rc.aggregate_loss(loss, torch.zeros(2, 3), "seq-mean-token-sum").item() == 0.0


def test_sequence_rejected_by_masked_is_does_not_shrink_seq_mean_token_sum() -> None:
    # Two sequences at ratio 1 with advantages 1 (row 0) and 2 (row 1); sequence-level masked IS
    # rejects row 1 (its behaviour ratio is e^2 > mis_high). Row 0 alone: loss −(1 + 1) / 1 = −2,
    # gradient −1 on each of its tokens (not −1/2, which dividing by both rows would give).
    logp = torch.zeros(2, 2)
    behaviour = torch.tensor([[0.0, 0.0], [-2.0, -2.0]])
    adv = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    cfg = rc.AlgorithmConfig(decoupled=True, mis_level="sequence", loss_agg_mode="seq-mean-token-sum")
    loss, grad, diag = _loss_and_grad(cfg, logp, behaviour, adv, torch.ones(2, 2), proximal_logprobs=logp.clone())
    assert loss.item() == pytest.approx(-2.0)
    torch.testing.assert_close(grad, torch.tensor([[-1.0, -1.0], [0.0, 0.0]]))
    assert diag["is_masked_frac"] == 0.5


def test_log_ratio_is_clamped_at_plus_minus_20() -> None:
    # ppo: log r = 100, A = −1 → r = e^20, loss max(e^20, 1.2) = e^20 (finite);
    # log r = −100, A = 1 → r = e^−20, loss max(−e^−20, −0.8) = −e^−20; neither takes the clipped branch.
    # sapo: gate σ(τ(e^±20 − 1)) for log r = ±100.
    log_ratio = torch.tensor([[100.0, -100.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    loss, clipped, _ = rc.ppo_clip_loss(log_ratio, adv, 0.2, 0.2)
    torch.testing.assert_close(loss, torch.tensor([[math.exp(20.0), -math.exp(-20.0)]]))
    assert clipped.tolist() == [[False, False]]
    sapo, _ = rc.sapo_loss(log_ratio, adv, tau_pos=1.0, tau_neg=1.05)
    tau = torch.tensor([[1.05, 1.0]])
    expected = -(4 / tau) * torch.sigmoid(tau * (torch.exp(torch.tensor([[20.0, -20.0]])) - 1)) * adv
    torch.testing.assert_close(sapo, expected)


@pytest.mark.parametrize("policy_loss", ALL_LOSSES)
@pytest.mark.parametrize("advantage", [1.0, -1.0])
@pytest.mark.parametrize("decoupled", [False, True])
def test_one_token_with_behaviour_logprob_minus_100_keeps_the_gradient_finite(
    policy_loss: str, advantage: float, decoupled: bool
) -> None:
    # log π_θ ≈ −1 against log μ = −100 on one token: exp(99) overflows float32 without the clamp.
    logp, old, _, mask = _batch(6)
    old[1, 2] = -100.0
    adv = torch.full_like(logp, advantage)
    cfg = rc.AlgorithmConfig(policy_loss=policy_loss, decoupled=decoupled, dual_clip_c=None)
    prox = {"proximal_logprobs": old.clone()} if decoupled else {}
    loss, grad, diag = _loss_and_grad(cfg, logp, old, adv, mask, **prox)
    assert torch.isfinite(loss)
    assert torch.all(torch.isfinite(grad))
    assert all(math.isfinite(v) for v in diag.values())
    # The other tokens still learn: at ratio ≈ 1 each gets about −A / N.
    others = mask.bool().clone()
    others[1, 2] = False
    assert grad[others].abs().sum() > 0

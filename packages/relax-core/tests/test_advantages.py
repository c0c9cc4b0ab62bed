"""Advantage estimators against hand-computed values and straightforward reference loops."""

from __future__ import annotations

import math

import pytest
import torch

import relax_core as rc


def _ref_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """Textbook GAE on one unmasked trajectory, written as the explicit sum Σ (γλ)^l δ_{t+l}."""
    n = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)]
    return [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, n)) for t in range(n)]


def test_gae_matches_hand_computed_values() -> None:
    # rewards (0, 0, 1), values 0.5 each, γ = 0.9, λ = 0.95:
    # δ = (0.45 − 0.5, 0.45 − 0.5, 1 − 0.5) = (−0.05, −0.05, 0.5)
    # A_2 = 0.5; A_1 = −0.05 + 0.855·0.5 = 0.3775; A_0 = −0.05 + 0.855·0.3775 = 0.2727625
    adv, ret = rc.gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.full((1, 3), 0.5), torch.ones(1, 3), 0.9, 0.95)
    torch.testing.assert_close(adv, torch.tensor([[0.2727625, 0.3775, 0.5]]))
    torch.testing.assert_close(ret, adv + 0.5)


def test_gae_matches_reference_loop_on_random_data() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 7, generator=gen), torch.randn(4, 7, generator=gen)
    adv, _ = rc.gae_advantages(rewards, values, torch.ones(4, 7), gamma=0.97, lam=0.8)
    for b in range(4):
        expected = _ref_gae(rewards[b].tolist(), values[b].tolist(), 0.97, 0.8)
        torch.testing.assert_close(adv[b], torch.tensor(expected), rtol=1e-5, atol=1e-5)


def test_gae_lambda_one_is_discounted_return_minus_value() -> None:
    gen = torch.Generator().manual_seed(1)
    rewards, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    gamma = 0.9
    adv, ret = rc.gae_advantages(rewards, values, torch.ones(3, 6), gamma=gamma, lam=1.0)
    mc = torch.tensor([[sum(gamma ** (k - t) * r[k] for k in range(t, 6)) for t in range(6)] for r in rewards.tolist()])
    torch.testing.assert_close(adv, mc - values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, mc, rtol=1e-5, atol=1e-5)


def test_gae_skips_masked_environment_tokens_and_padding() -> None:
    # Tokens [gen, env, gen, pad]: the env token is skipped, so the result equals GAE on [gen, gen].
    rewards = torch.tensor([[0.2, 9.0, 1.0, 5.0]])
    values = torch.tensor([[0.1, 7.0, 0.3, 3.0]])
    mask = torch.tensor([[1, 0, 1, 0]])
    adv, ret = rc.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.7)
    expected = _ref_gae([0.2, 1.0], [0.1, 0.3], 0.9, 0.7)
    torch.testing.assert_close(adv, torch.tensor([[expected[0], 0.0, expected[1], 0.0]]))
    assert ret[0, 1] == 0.0 and ret[0, 3] == 0.0


def test_gae_bootstraps_last_value_for_truncated_sequences() -> None:
    adv, _ = rc.gae_advantages(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.5, 1.0, torch.tensor([2.0]))
    assert adv.item() == pytest.approx(1.0)  # δ = 0 + 0.5·2 − 0


def test_vtrace_on_policy_equals_lambda_one_return() -> None:
    gen = torch.Generator().manual_seed(2)
    rewards, values = torch.randn(3, 5, generator=gen), torch.randn(3, 5, generator=gen)
    logp = torch.randn(3, 5, generator=gen)
    out = rc.vtrace(rewards, values, logp, logp, torch.ones(3, 5), gamma=0.95, lam=1.0)
    _, ret = rc.gae_advantages(rewards, values, torch.ones(3, 5), gamma=0.95, lam=1.0)
    torch.testing.assert_close(out.targets, ret, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.rhos, torch.ones(3, 5))


def _ref_vtrace(r: list[float], v: list[float], ratio: list[float], gamma: float, rho_bar: float, c_bar: float):
    """IMPALA eq. 1 written as the explicit sum v_s = V_s + Σ_t γ^{t−s} (Π_{i<t} c_i) ρ_t δ_t."""
    n = len(r)
    rho = [min(rho_bar, x) for x in ratio]
    c = [min(c_bar, x) for x in ratio]
    v_next = [*v[1:], 0.0]
    targets = []
    for s in range(n):
        total = v[s]
        for t in range(s, n):
            trace = math.prod(c[s:t])
            total += gamma ** (t - s) * trace * rho[t] * (r[t] + gamma * v_next[t] - v[t])
        targets.append(total)
    adv = [r[s] + gamma * (targets[s + 1] if s + 1 < n else 0.0) - v[s] for s in range(n)]
    return targets, adv


def test_vtrace_off_policy_matches_explicit_sum() -> None:
    gen = torch.Generator().manual_seed(3)
    rewards, values = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    target, behaviour = torch.randn(2, 6, generator=gen) * 0.5, torch.randn(2, 6, generator=gen) * 0.5
    out = rc.vtrace(rewards, values, target, behaviour, torch.ones(2, 6), gamma=0.9, rho_bar=1.0, c_bar=0.8)
    for b in range(2):
        ratio = torch.exp(target[b] - behaviour[b]).tolist()
        exp_targets, exp_adv = _ref_vtrace(rewards[b].tolist(), values[b].tolist(), ratio, 0.9, 1.0, 0.8)
        torch.testing.assert_close(out.targets[b], torch.tensor(exp_targets), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.advantages[b], torch.tensor(exp_adv), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out.rhos[b], torch.tensor([min(1.0, x) for x in ratio]))


def test_grpo_with_and_without_std() -> None:
    scores = torch.tensor([1.0, 0.0, 0.0, 3.0, 1.0, 2.0])
    groups = ["p", "p", "p", "q", "q", "q"]
    # group p: mean 1/3, unbiased std sqrt(1/3); group q: mean 2, std 1
    dr = rc.grpo_advantages(scores, groups, norm_by_std=False)
    torch.testing.assert_close(dr, torch.tensor([2 / 3, -1 / 3, -1 / 3, 1.0, -1.0, 0.0]))
    std_p = math.sqrt(1 / 3)
    full = rc.grpo_advantages(scores, groups, eps=0.0)
    torch.testing.assert_close(full, torch.tensor([2 / 3 / std_p, -1 / 3 / std_p, -1 / 3 / std_p, 1.0, -1.0, 0.0]))


def test_grpo_equal_rewards_and_singletons_give_zero() -> None:
    adv = rc.grpo_advantages(torch.tensor([1.0, 1.0, 5.0]), [0, 0, 1])
    torch.testing.assert_close(adv, torch.zeros(3))


def test_rloo_leave_one_out() -> None:
    adv = rc.rloo_advantages(torch.tensor([1.0, 0.0, 0.0, 2.0]), ["a", "a", "a", "a"])
    # mean of the others: (0+0+2)/3, (1+0+2)/3, (1+0+2)/3, (1+0+0)/3
    torch.testing.assert_close(adv, torch.tensor([1 - 2 / 3, -1.0, -1.0, 2 - 1 / 3]))


def test_group_ids_may_be_a_tensor_and_interleaved() -> None:
    scores = torch.tensor([1.0, 5.0, 3.0, 7.0])
    adv = rc.grpo_advantages(scores, torch.tensor([10, 20, 10, 20]), norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([-1.0, -1.0, 1.0, 1.0]))


def test_reinforce_pp_is_whitened_discounted_return() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, -1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    adv = rc.reinforce_pp_advantages(rewards, mask, gamma=0.5)
    # returns on valid tokens: [0.5, 1.0] and [-0.25, -0.5, -1.0]
    returns = torch.tensor([0.5, 1.0, -0.25, -0.5, -1.0])
    expected = (returns - returns.mean()) / returns.std()
    torch.testing.assert_close(adv[mask.bool()], expected, rtol=1e-4, atol=1e-4)
    assert adv[0, 2] == 0.0


def test_reinforce_pp_baseline() -> None:
    scores = torch.tensor([1.0, 0.0, 2.0, 2.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    adv = rc.reinforce_pp_baseline_advantages(scores, ["a", "a", "b", "b"], mask)
    centred = torch.tensor([0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 0.0])  # valid tokens in row order
    expected = (centred - centred.mean()) / centred.std()
    torch.testing.assert_close(adv[mask.bool()], expected, rtol=1e-4, atol=1e-4)


def test_masked_whiten_ignores_masked_entries() -> None:
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 4.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = rc.masked_whiten(values, mask)
    valid = torch.tensor([1.0, 2.0, 3.0, 4.0])
    torch.testing.assert_close(out[mask.bool()], (valid - 2.5) / valid.std(), rtol=1e-5, atol=1e-5)
    assert out[0, 2] == 0.0 and out[1, 1] == 0.0
    kept = rc.masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(kept[mask.bool()], (valid - 2.5) / valid.std() + 2.5, rtol=1e-5, atol=1e-5)


def test_dynamic_sampling_keeps_groups_with_signal() -> None:
    keep = rc.dynamic_sampling_keep(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0]), ["a", "a", "b", "b", "c", "c"])
    assert keep.tolist() == [False, False, True, True, False, False]


def test_broadcast_and_outcome_token_rewards() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    torch.testing.assert_close(
        rc.broadcast_to_tokens(torch.tensor([2.0, 3.0, 4.0]), mask),
        torch.tensor([[2.0, 2.0, 0.0], [0.0, 0.0, 0.0], [4.0, 0.0, 4.0]]),
    )
    torch.testing.assert_close(
        rc.outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask),
        torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 4.0]]),
    )


def test_compute_advantages_dispatch() -> None:
    mask = torch.ones(4, 3)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    groups = ["a", "a", "b", "b"]
    out = rc.compute_advantages(rc.AlgorithmConfig(group_size=2, norm_adv_by_std=False), scores, mask, group_ids=groups)
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor([0.5, -0.5, 0.0, 0.0]))
    assert out.returns is None

    cfg = rc.load_preset("ppo", {"whiten_advantages": False, "kl_coef": 0.0})
    values = torch.full((4, 3), 0.25)
    out = rc.compute_advantages(cfg, scores, mask, values=values)
    expected, returns = rc.gae_advantages(rc.outcome_token_rewards(scores, mask), values, mask, 1.0, 0.95)
    torch.testing.assert_close(out.advantages, expected)
    assert out.returns is not None
    torch.testing.assert_close(out.returns, returns)


def test_compute_advantages_kl_reward_penalty() -> None:
    cfg = rc.load_preset("reinforce_pp", {"kl_coef": 0.5, "kl_estimator": "k1"})
    mask = torch.ones(1, 2)
    old = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.2, -0.6]])  # k1 = old − ref = (0.2, −0.4)
    out = rc.compute_advantages(cfg, torch.tensor([1.0]), mask, old_logprobs=old, ref_logprobs=ref)
    torch.testing.assert_close(out.token_rewards, torch.tensor([[-0.1, 1.2]]))


def test_compute_advantages_missing_inputs() -> None:
    mask = torch.ones(2, 2)
    with pytest.raises(ValueError, match="group_ids"):
        rc.compute_advantages(rc.AlgorithmConfig(), torch.zeros(2), mask)
    with pytest.raises(ValueError, match="critic values"):
        rc.compute_advantages(rc.load_preset("ppo", {"kl_coef": 0.0}), torch.zeros(2), mask)
    with pytest.raises(ValueError, match="ref_logprobs"):
        rc.compute_advantages(rc.load_preset("rloo"), torch.zeros(2), mask, group_ids=[0, 0])


def test_compute_advantages_vtrace_uses_proximal_as_target() -> None:
    cfg = rc.AlgorithmConfig(advantage_estimator="vtrace", gamma=0.9, lam=1.0, vtrace_rho_bar=1.0, vtrace_c_bar=1.0)
    gen = torch.Generator().manual_seed(9)
    values = torch.randn(2, 3, generator=gen)
    behaviour = -torch.rand(2, 3, generator=gen)
    prox = behaviour + 0.3 * torch.randn(2, 3, generator=gen)
    mask = torch.ones(2, 3)
    scores = torch.tensor([1.0, -1.0])
    out = rc.compute_advantages(cfg, scores, mask, values=values, old_logprobs=behaviour, proximal_logprobs=prox)
    direct = rc.vtrace(rc.outcome_token_rewards(scores, mask), values, prox, behaviour, mask, 0.9, 1.0)
    assert out.returns is not None
    torch.testing.assert_close(out.returns, direct.targets)
    torch.testing.assert_close(out.advantages, direct.advantages)


def test_compute_advantages_grpo_with_reward_kl_subtracts_summed_penalty() -> None:
    cfg = rc.AlgorithmConfig(group_size=2, norm_adv_by_std=False, kl_coef=1.0, kl_estimator="k1", kl_placement="reward")
    mask = torch.tensor([[1, 1], [1, 0]])
    old = torch.zeros(2, 2)
    ref = torch.tensor([[-0.1, -0.2], [-0.3, -9.0]])  # k1 = old − ref on valid tokens: (0.1, 0.2), (0.3)
    out = rc.compute_advantages(
        cfg, torch.tensor([1.0, 1.0]), mask, group_ids=[0, 0], old_logprobs=old, ref_logprobs=ref
    )
    # penalised scores 1 − 0.3 = 0.7 and 1 − 0.3 = 0.7 → equal → zero advantage
    torch.testing.assert_close(out.advantages, torch.zeros(2, 2))

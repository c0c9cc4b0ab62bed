"""Advantage estimators opo, grpo_passk, gpg and remax through :func:`relax_core.compute_advantages`, against
plain-Python re-computations on seeded scores with mixed group sizes (a group of one included), padding and a hole
in the mask."""

from __future__ import annotations

import statistics

import pytest
import torch

import relax_core as rc

GROUPS = ["a", "b", "a", "c", "b", "a", "d", "d", "d", "d", "e", "e"]  # sizes 3, 2, 1, 4, 2; interleaved
T = 6


def _batch(seed: int) -> tuple[list[float], list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randint(0, 3, (len(GROUPS),), generator=gen).double().tolist()  # ties and zeros happen
    scores[10], scores[11] = 1.0, 1.0  # a group whose best two tie
    lengths = torch.randint(1, T + 1, (len(GROUPS),), generator=gen).tolist()
    mask = [[1 if t < n else 0 for t in range(T)] for n in lengths]
    mask[3][0] = 0 if lengths[3] > 1 else 1  # a hole (an environment token) inside a response
    return scores, mask


def _members() -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(GROUPS):
        groups.setdefault(g, []).append(i)
    return groups


def _advantages(estimator: str, scores: list[float], mask: list[list[int]], **cfg: object) -> list[list[float]]:
    config = rc.load_config(rc.AlgorithmConfig, {"advantage_estimator": estimator, "group_size": 2, **cfg})
    out = rc.compute_advantages(config, torch.tensor(scores, dtype=torch.float64), torch.tensor(mask), group_ids=GROUPS)
    return out.advantages.tolist()


def _check(got: list[list[float]], seq_adv: list[float], mask: list[list[int]]) -> None:
    for row, adv, m in zip(got, seq_adv, mask, strict=True):
        assert row == pytest.approx([adv if v else 0.0 for v in m], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_opo(seed: int) -> None:
    scores, mask = _batch(seed)
    want = [0.0] * len(GROUPS)
    for members in _members().values():
        if len(members) < 2:
            continue
        lengths = {i: sum(mask[i]) for i in members}
        baseline = sum(lengths[i] * scores[i] for i in members) / sum(lengths.values())
        for i in members:
            want[i] = scores[i] - baseline
    _check(_advantages("opo", scores, mask), want, mask)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_grpo_passk(seed: int, norm: bool) -> None:
    scores, mask = _batch(seed)
    want = [0.0] * len(GROUPS)
    for members in _members().values():
        if len(members) < 2:
            continue
        values = [scores[i] for i in members]
        best = members[values.index(max(values))]
        margin = sorted(values, reverse=True)[0] - sorted(values, reverse=True)[1]
        want[best] = margin / (statistics.stdev(values) + 1e-6) if norm else margin
    _check(_advantages("grpo_passk", scores, mask, norm_adv_by_std=norm), want, mask)
    assert want[10] == 0.0 and want[11] == 0.0  # the tied group credits nobody


@pytest.mark.parametrize("seed", range(4))
def test_gpg(seed: int) -> None:
    scores, mask = _batch(seed)
    alpha = len(scores) / max(sum(1 for s in scores if s != 0), 1)
    want = [0.0] * len(GROUPS)
    for members in _members().values():
        if len(members) < 2:
            continue
        mean = sum(scores[i] for i in members) / len(members)
        for i in members:
            want[i] = alpha * (scores[i] - mean)
    _check(_advantages("gpg", scores, mask), want, mask)


def test_gpg_alpha_by_hand() -> None:
    # 4 samples, 1 non-zero reward: α = 4; group mean 0.5 in the first group, 0 in the second.
    adv = rc.gpg_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), [0, 0, 1, 1])
    assert adv.tolist() == pytest.approx([2.0, -2.0, 0.0, 0.0])


@pytest.mark.parametrize("seed", range(3))
def test_remax(seed: int) -> None:
    scores, mask = _batch(seed)
    gen = torch.Generator().manual_seed(100 + seed)
    greedy = torch.rand(len(GROUPS), generator=gen, dtype=torch.float64).tolist()
    cfg = rc.AlgorithmConfig(advantage_estimator="remax", group_size=1)
    score_t, mask_t = torch.tensor(scores, dtype=torch.float64), torch.tensor(mask)
    out = rc.compute_advantages(cfg, score_t, mask_t, reward_baselines=torch.tensor(greedy, dtype=torch.float64))
    # Outcome reward on the last token: the reward-to-go is the score at every valid token.
    _check(out.advantages.tolist(), [s - b for s, b in zip(scores, greedy, strict=True)], mask)
    with pytest.raises(ValueError, match="reward_baselines"):
        rc.compute_advantages(cfg, score_t, mask_t)


def test_remax_reward_to_go_with_token_rewards() -> None:
    # Token rewards [0.1, −0.2, (hole), 1.0] and baseline 0.5: returns 0.9, 0.8, –, 1.0; minus 0.5.
    rewards = torch.tensor([[0.1, -0.2, 7.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0, 1, 0]])
    adv = rc.remax_advantages(rewards, torch.tensor([0.5]), mask)
    assert adv.tolist()[0] == pytest.approx([0.4, 0.3, 0.0, 0.5, 0.0])


def test_each_estimator_is_a_config_value() -> None:
    for name in ("opo", "grpo_passk", "gpg", "remax"):
        assert name in rc.estimator_names()
        assert (
            rc.load_config(rc.AlgorithmConfig, {"advantage_estimator": name, "group_size": 2}).advantage_estimator
            == name
        )
    assert rc.load_preset("gpg").policy_loss == "gpg"

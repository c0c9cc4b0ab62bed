"""Environment tokens of a multi-turn rollout are context only: the sample row's ``loss_mask`` (1 policy token, 0
environment/tool token) reaches every loss, estimator, unit count and metric of an update.

The checks look at gradients, not at masks: the gradient of the loss with respect to each position's log-prob,
entropy and value is exactly 0 on environment tokens, and perturbing what a row holds for its environment tokens
(advantages, behaviour and reference log-probs, old values, return targets) leaves the parameter gradient bit for
bit the same, while perturbing a policy token's changes it. References are computed here: token and sequence
counts from the rows, GAE by its recursion over each row's policy tokens alone.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_core import aggregation_units
from relax_queue import GroupBatcher, RowInput, TransferQueue
from relax_services.config import RunConfig, load_run_config
from relax_services.control.checkpoint import PROMPTS_FILE, SAMPLES_FILE, load_queue_snapshots
from relax_services.control.pipeline import queue_configs
from relax_services.engines import LOSS_MASK_FIELD, Completion, LossInputs, LossResult, TrainEngine, TrainSample
from relax_services.engines.torch import build_train_engine, build_value_engine
from relax_services.engines.torch.train import TorchTrainEngine
from relax_services.models import text_prompt
from relax_services.models.tiny_families import write_tiny_checkpoint
from relax_services.rows import loss_mask_of, sample_key
from relax_services.services import TrainerService
from relax_services.services.trainer import (
    build_train_samples,
    env_token_frac,
    make_loss_fn,
    make_value_loss_fn,
    trainer_fields,
)
from relax_services.weights import InProcessWeightStore

GROUPS, GROUP_SIZE = 3, 2
VERSION = 0

# Which response positions are environment tokens, per sample (groups of GROUP_SIZE in order): a tool output in
# the middle, one at the end, two turns, none, and a sample with no policy token at all (left out of every
# sequence count).
ENV_POSITIONS: list[set[int]] = [{2, 3}, {4, 5}, {1, 4}, set(), {0, 1, 2, 3, 4, 5}, {3}]
LENGTH = 6


def _mask(i: int) -> list[int]:
    return [0 if t in ENV_POSITIONS[i] else 1 for t in range(LENGTH)]


def _rows(with_mask: bool = True) -> list[dict[str, Any]]:
    """Sample rows as the Rollout, Reward and Reference write them; behaviour log-probs filled by :func:`_score`."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for g in range(GROUPS):
        prompt = text_prompt(torch.randint(10, 40, (3 + g,), generator=gen).tolist())
        for j in range(GROUP_SIZE):
            i = g * GROUP_SIZE + j
            row = {
                "prompt": prompt,
                "meta": {"prompt_key": f"p{g}", "task": "text", "answer": "1"},
                "response": torch.randint(10, 40, (LENGTH,), generator=gen).tolist(),
                "logprobs": [0.0] * LENGTH,
                "token_versions": [VERSION] * LENGTH,
                "reward": float((i * 7) % 3) / 2.0,
                "reward_error": None,
            }
            if with_mask:
                row["loss_mask"] = _mask(i)
            rows.append(row)
    return rows


def _score(engine: TrainEngine, rows: list[dict[str, Any]]) -> None:
    """Behaviour log-probs = the trainer's plus small noise on policy tokens and 0 on environment tokens (what a
    rollout writes for them); reference log-probs = the trainer's plus other noise on every token (the Reference
    scores whole responses)."""
    plain = [TrainSample(prompt=r["prompt"], response_ids=torch.tensor(r["response"])) for r in rows]
    trainer_lp, _ = engine.compute_logprobs(plain)  # [B, T]
    gen = torch.Generator().manual_seed(1)
    for i, r in enumerate(rows):
        mask = torch.tensor(loss_mask_of(r), dtype=torch.bool)  # [L]
        noisy = trainer_lp[i, :LENGTH] + 0.1 * torch.randn(LENGTH, generator=gen)
        r["logprobs"] = torch.where(mask, noisy, 0.0).tolist()
        r["ref_logprobs"] = (trainer_lp[i, :LENGTH] + 0.2 * torch.randn(LENGTH, generator=gen)).tolist()


def _cfg(folder: Path, *overrides: str) -> RunConfig:
    return load_run_config(
        None,
        [
            f"model.source={folder}",
            f"trainer.groups_per_step={GROUPS}",
            "trainer.micro_batch_groups=1",  # several micro-batches: the units combine them
            f"algorithm.group_size={GROUP_SIZE}",
            *overrides,
        ],
    )


def _policy_cfg(folder: Path, agg: str, kl: str = "k3") -> RunConfig:
    """The policy loss with every term on: KL in the loss, an entropy bonus, decoupled PPO with token-level masked
    IS (a behaviour log-prob of 0 on an environment token would be rejected, or weigh e^|log π|, if it counted)."""
    return _cfg(
        folder,
        f"algorithm.loss_agg_mode={agg}",
        "algorithm.kl_coef=0.1",
        "algorithm.kl_placement=loss",
        f"algorithm.kl_estimator={kl}",
        "algorithm.entropy_coef=0.01",
        "algorithm.decoupled=true",
        "algorithm.mis_level=token",
    )


Probe = list[tuple[LossInputs, LossResult, tuple[torch.Tensor, ...]]]


def _probing(
    loss_fn: Callable[[LossInputs], Any], wrt: Callable[[LossInputs], list[torch.Tensor]]
) -> tuple[Any, Probe]:
    """``loss_fn`` that also records, per micro-batch, its inputs, its result and the gradient of its loss with
    respect to the tensors ``wrt`` picks (per-position log-probs, entropy, values)."""
    seen: Probe = []

    def probe(inputs: LossInputs) -> LossResult:
        result = loss_fn(inputs)
        grads = torch.autograd.grad(result.loss, wrt(inputs), retain_graph=True, allow_unused=True)
        seen.append((inputs, result, tuple(torch.zeros(()) if g is None else g for g in grads)))
        return result

    return probe, seen


def _gradients(engine: TorchTrainEngine, samples: list[TrainSample], loss_fn: Any) -> dict[str, torch.Tensor]:
    engine.model.zero_grad(set_to_none=True)
    engine.accumulate_gradients(samples, loss_fn)
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def _perturbed(samples: list[TrainSample], names: tuple[str, ...], where: str, seed: int = 2) -> list[TrainSample]:
    """A copy of ``samples`` whose ``names`` fields hold other values on the ``where`` tokens ("env" or "policy")."""
    gen = torch.Generator().manual_seed(seed)
    out = copy.deepcopy(samples)
    for s in out:
        env = s.fields[LOSS_MASK_FIELD] == 0  # [L]
        pick = env if where == "env" else ~env
        for name in names:
            noise = 5.0 * torch.randn(s.fields[name].shape, generator=gen)
            s.fields[name] = torch.where(pick, s.fields[name] + noise, s.fields[name])
    return out


def _env(inputs_mask_shape: torch.Size, offset: int) -> torch.Tensor:
    """``[B, T]`` bool: the environment tokens of the micro-batch whose first sample is sample ``offset``."""
    out = torch.zeros(inputs_mask_shape, dtype=torch.bool)
    for b in range(inputs_mask_shape[0]):
        for t in ENV_POSITIONS[offset + b]:
            out[b, t] = True
    return out


@pytest.mark.parametrize(("agg", "kl"), [("token-mean", "k3"), ("seq-mean-token-mean", "k3"), ("token-mean", "full")])
def test_env_tokens_get_exactly_zero_policy_gradient(tmp_path: Path, agg: str, kl: str) -> None:
    """With ``kl='full'`` the KL term is the engine's exact full-vocabulary KL against its own frozen reference."""
    cfg = _policy_cfg(write_tiny_checkpoint(tmp_path / "q2", "qwen2"), agg, kl)
    engine = build_train_engine(cfg)
    rows = _rows()
    _score(engine, rows)
    samples = build_train_samples(cfg, rows, None, version=VERSION)
    # Per position: log-prob, entropy and (full KL) the engine's exact KL, each with its own gradient path.
    probe, seen = _probing(make_loss_fn(cfg), lambda x: [x.logprobs, x.entropy, *([x.full_kl] * (kl == "full"))])
    grads = _gradients(engine, samples, probe)

    # The gradient of each micro-batch's loss w.r.t. each of them: 0 on env tokens, not 0 on the policy's (so the
    # check can fail).
    offset = 0
    for inputs, _, per_position in seen:
        assert (inputs.full_kl is not None) == (kl == "full") and len(per_position) == 2 + (kl == "full")
        env = _env(inputs.mask.shape, offset)
        offset += inputs.mask.shape[0]
        policy = inputs.mask.bool()
        assert torch.equal(policy, ~env & (torch.arange(inputs.mask.shape[1]) < LENGTH))
        for grad in per_position:
            assert torch.equal(grad[env], torch.zeros(int(env.sum())))
            assert bool((grad[policy] != 0).all())

    # The parameter gradient: env tokens' advantages, behaviour and reference log-probs do not enter it ...
    names = ("advantages", "old_logprobs", "ref_logprobs")
    probe_env, _ = _probing(make_loss_fn(cfg), lambda x: [x.logprobs])
    env_grads = _gradients(engine, _perturbed(samples, names, "env"), probe_env)
    assert grads.keys() == env_grads.keys()
    assert all(torch.equal(grads[n], env_grads[n]) for n in grads)
    # ... the policy tokens' do.
    policy_grads = _gradients(engine, _perturbed(samples, names, "policy"), make_loss_fn(cfg))
    assert any(not torch.equal(grads[n], policy_grads[n]) for n in grads)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_units_and_token_metrics_count_policy_tokens_only(tmp_path: Path, agg: str) -> None:
    cfg = _policy_cfg(write_tiny_checkpoint(tmp_path / "q2", "qwen2"), agg)
    engine = build_train_engine(cfg)
    rows = _rows()
    _score(engine, rows)
    samples = build_train_samples(cfg, rows, None, version=VERSION)
    probe, seen = _probing(make_loss_fn(cfg), lambda x: [x.logprobs])
    engine.model.zero_grad(set_to_none=True)
    metrics = engine.accumulate_gradients(samples, probe)

    masks = [_mask(i) for i in range(len(rows))]
    policy_tokens = sum(map(sum, masks))  # 36 response tokens, 13 of them environment tokens
    assert policy_tokens == 23
    with_policy_token = sum(any(m) for m in masks)  # 5: one sample is all environment tokens
    expected_units = policy_tokens if agg == "token-mean" else with_policy_token
    assert sum(result.units for _, result, _ in seen) == expected_units  # noise 0.1: masked IS keeps every token
    assert metrics["tokens"] == policy_tokens
    # The mismatch metrics count the policy's tokens (all sampled by the current version here).
    counted = sum(result.metrics["rollout_mismatch_tokens_per_unit"] * max(result.units, 1.0) for _, result, _ in seen)
    assert counted == pytest.approx(policy_tokens, abs=1e-9)
    assert env_token_frac(rows) == (36 - policy_tokens) / 36
    # Each micro-batch's units are those of its own (policy-token) mask.
    for inputs, result, _ in seen:
        assert result.units == aggregation_units(inputs.mask, agg)  # type: ignore[arg-type]


def _params_after_update(cfg: RunConfig, samples: list[TrainSample]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    engine = build_train_engine(cfg)
    engine.step(samples, make_loss_fn(cfg))
    return engine.policy_state()


def test_update_over_rows_with_and_without_an_all_ones_mask_is_bit_identical(tmp_path: Path) -> None:
    cfg = _policy_cfg(write_tiny_checkpoint(tmp_path / "q2", "qwen2"), "token-mean")
    without = _rows(with_mask=False)
    _score(build_train_engine(cfg), without)
    ones = [{**r, "loss_mask": [1] * LENGTH} for r in without]
    empty = [{**r, "loss_mask": []} for r in without]  # a restored older snapshot's row
    reference = build_train_samples(cfg, without, None, version=VERSION)
    # The samples as the Trainer built them before masks existed: no loss-mask field at all.
    bare = [
        TrainSample(s.prompt, s.response_ids, {k: v for k, v in s.fields.items() if k != LOSS_MASK_FIELD})
        for s in reference
    ]
    expected = _params_after_update(cfg, bare)
    for variant in (without, ones, empty):
        state = _params_after_update(cfg, build_train_samples(cfg, variant, None, version=VERSION))
        assert all(torch.equal(state[n], expected[n]) for n in expected)
    masked = [{**r, "loss_mask": _mask(i)} for i, r in enumerate(without)]
    moved = _params_after_update(cfg, build_train_samples(cfg, masked, None, version=VERSION))
    assert any(not torch.equal(moved[n], expected[n]) for n in expected)  # a real mask does change the update


def _hand_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """GAE (Schulman et al. 2016, eq. 16) over one sequence: advantages and returns."""
    adv, running, next_value = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        running = delta + gamma * lam * running
        adv[t], next_value = running, values[t]
    return adv, [a + v for a, v in zip(adv, values, strict=True)]


def test_gae_and_the_critic_skip_env_tokens(tmp_path: Path) -> None:
    gamma, lam = 0.9, 0.8
    cfg = _cfg(
        write_tiny_checkpoint(tmp_path / "q2", "qwen2"),
        "algorithm.advantage_estimator=gae",
        "staleness.tau=0",
        f"algorithm.gamma={gamma}",
        f"algorithm.lam={lam}",
    )
    rows = _rows()
    gen = torch.Generator().manual_seed(3)
    for r in rows:
        r["logprobs"] = (-torch.rand(LENGTH, generator=gen)).tolist()
        r["values"] = torch.randn(LENGTH, generator=gen).tolist()
    samples = build_train_samples(cfg, rows, None, version=VERSION)

    # Reference: GAE over each row's policy tokens alone, the outcome reward on its last policy token; env tokens
    # get advantage 0 and return 0. Float32 against float64: the recursion's terms are O(1) over 6 steps.
    for i, (row, sample) in enumerate(zip(rows, samples, strict=True)):
        policy = [t for t in range(LENGTH) if t not in ENV_POSITIONS[i]]
        rewards = [0.0] * len(policy)
        if policy:
            rewards[-1] = row["reward"]
        adv, ret = _hand_gae(rewards, [row["values"][t] for t in policy], gamma, lam)
        want_adv, want_ret = torch.zeros(LENGTH, dtype=torch.float64), torch.zeros(LENGTH, dtype=torch.float64)
        want_adv[policy], want_ret[policy] = (
            torch.tensor(adv, dtype=torch.float64),
            torch.tensor(ret, dtype=torch.float64),
        )
        torch.testing.assert_close(sample.fields["advantages"].double(), want_adv, atol=1e-5, rtol=0)
        torch.testing.assert_close(sample.fields["returns"].double(), want_ret, atol=1e-5, rtol=0)
        env = torch.tensor([t in ENV_POSITIONS[i] for t in range(LENGTH)])
        assert torch.equal(sample.fields["advantages"][env], torch.zeros(int(env.sum())))

    # The critic's value loss: 0 gradient w.r.t. each env position's value; env tokens' targets do not enter it.
    # Old values are the critic's own (as at the update's first step), so the value clip is not active.
    critic = build_value_engine(cfg)
    current, _ = critic.compute_values(samples)  # [B, T]
    for i, sample in enumerate(samples):
        sample.fields["old_values"] = current[i, :LENGTH]
    probe, seen = _probing(make_value_loss_fn(cfg), lambda x: [x.values])
    grads = _gradients(critic, samples, probe)
    offset = 0
    for inputs, _, (g_values,) in seen:
        env = _env(inputs.mask.shape, offset)
        offset += inputs.mask.shape[0]
        assert torch.equal(g_values[env], torch.zeros(int(env.sum())))
        # (a policy position may have 0 too: the last one of a reward-0 sample has return 0 = the zero head's value)
        assert bool((g_values[inputs.mask.bool()] != 0).any())
    env_grads = _gradients(critic, _perturbed(samples, ("old_values", "returns"), "env"), make_value_loss_fn(cfg))
    assert all(torch.equal(grads[n], env_grads[n]) for n in grads)
    policy_grads = _gradients(critic, _perturbed(samples, ("returns",), "policy"), make_value_loss_fn(cfg))
    assert any(not torch.equal(grads[n], policy_grads[n]) for n in grads)


def _sample_queue(cfg: RunConfig) -> tuple[TransferQueue, TransferQueue]:
    prompts, samples = queue_configs(cfg)
    return TransferQueue(prompts), TransferQueue(samples)


def _put(queue: TransferQueue, rows: list[dict[str, Any]]) -> None:
    queue.put_many(
        [
            RowInput(
                key=sample_key(r["meta"]["prompt_key"], i % GROUP_SIZE),
                fields=r,
                versions=VERSION,
                group_id=r["meta"]["prompt_key"],
                group_size=GROUP_SIZE,
            )
            for i, r in enumerate(rows)
        ]
    )


def test_queue_snapshots_keep_the_mask_and_older_rows_load_as_all_policy_tokens(tmp_path: Path) -> None:
    cfg = _cfg(write_tiny_checkpoint(tmp_path / "q2", "qwen2"))
    fields = trainer_fields(cfg)
    assert "loss_mask" in fields
    for with_mask in (True, False):
        prompt_queue, sample_queue = _sample_queue(cfg)
        _put(sample_queue, [{**r, "ref_logprobs": [-1.0] * LENGTH} for r in _rows(with_mask)])
        folder = tmp_path / f"step_{with_mask}"
        folder.mkdir()
        prompt_queue.save(folder / PROMPTS_FILE)
        sample_queue.save(folder / SAMPLES_FILE)
        restored_prompts, restored = _sample_queue(cfg)
        load_queue_snapshots(restored_prompts, restored, folder)
        batch = restored.reader("trainer", fields, GroupBatcher(GROUPS)).get(timeout=5)
        assert len(batch) == GROUPS * GROUP_SIZE
        got = {str(row.key): row.fields["loss_mask"] for row in batch.rows}
        for i, r in enumerate(_rows()):
            key = sample_key(r["meta"]["prompt_key"], i % GROUP_SIZE)
            assert got[key] == (_mask(i) if with_mask else [])
        if not with_mask:  # what the Trainer makes of an older row: every token the policy's
            assert all(loss_mask_of(row.fields) == [1] * LENGTH for row in batch.rows)  # type: ignore[arg-type]


def test_the_trainer_records_env_token_frac_and_trains_on_policy_tokens(tmp_path: Path) -> None:
    cfg = _policy_cfg(write_tiny_checkpoint(tmp_path / "q2", "qwen2"), "token-mean")
    _, sample_queue = _sample_queue(cfg)
    rows = _rows()
    _score(build_train_engine(cfg), rows)
    _put(sample_queue, rows)
    trainer = TrainerService("trainer", cfg, sample_queue, InProcessWeightStore(keep=1))
    while trainer.version == 0:
        trainer.step()
    (record,) = [r for r in trainer.report() if r["kind"] == "train"]
    assert record["env_token_frac"] == 13 / 36
    assert record["tokens"] == 23.0
    assert record["samples"] == GROUPS * GROUP_SIZE


def test_completion_mask_defaults_to_every_token_and_is_checked() -> None:
    assert Completion(token_ids=[5, 6, 7]).loss_mask == [1, 1, 1]
    assert Completion(token_ids=[5, 6, 7], mask=[1, 0, 1]).loss_mask == [1, 0, 1]
    with pytest.raises(ValueError, match="2 entries for 3 tokens"):
        _ = Completion(token_ids=[5, 6, 7], mask=[1, 0]).loss_mask
    with pytest.raises(ValueError, match="1 \\(policy token\\) or 0"):
        _ = Completion(token_ids=[5, 6], mask=[1, 2]).loss_mask
    assert loss_mask_of({"response": [4, 5], "loss_mask": [0, 1]}) == [0, 1]  # type: ignore[typeddict-item]
    assert loss_mask_of({"response": [4, 5]}) == [1, 1]  # type: ignore[typeddict-item]
    with pytest.raises(ValueError, match="3 entries for a response of 2 tokens"):
        loss_mask_of({"response": [4, 5], "loss_mask": [0, 1, 1]})  # type: ignore[typeddict-item]


def test_vtrace_runs_over_the_policy_tokens_alone(tmp_path: Path) -> None:
    """V-trace over rows with environment tokens equals V-trace over the same rows with those tokens cut out
    (behaviour log-probs 0 there, and target log-probs far from them: a ratio that counted would be e^±5)."""
    cfg = _cfg(
        write_tiny_checkpoint(tmp_path / "q2", "qwen2"),
        "algorithm.advantage_estimator=vtrace",
        "algorithm.gamma=0.9",
        "algorithm.lam=0.8",
    )
    rows = _rows()
    gen = torch.Generator().manual_seed(4)
    for i, r in enumerate(rows):
        behaviour = -torch.rand(LENGTH, generator=gen)
        r["logprobs"] = torch.where(torch.tensor(_mask(i), dtype=torch.bool), behaviour, 0.0).tolist()
        r["values"] = torch.randn(LENGTH, generator=gen).tolist()
    target = torch.tensor([r["logprobs"] for r in rows]) + 0.3 * torch.randn(len(rows), LENGTH, generator=gen)
    target = torch.where(torch.tensor([_mask(i) for i in range(len(rows))], dtype=torch.bool), target, -5.0)
    samples = build_train_samples(cfg, rows, target, version=VERSION)

    for i, (row, sample) in enumerate(zip(rows, samples, strict=True)):
        policy = [t for t in range(LENGTH) if t not in ENV_POSITIONS[i]]
        cut = {
            **row,
            "response": [row["response"][t] for t in policy],
            "logprobs": [row["logprobs"][t] for t in policy],
            "token_versions": [VERSION] * len(policy),
            "values": [row["values"][t] for t in policy],
            "loss_mask": [1] * len(policy),
        }
        if not policy:
            assert torch.equal(sample.fields["advantages"], torch.zeros(LENGTH))
            continue
        (alone,) = build_train_samples(cfg, [cut], target[i, policy].unsqueeze(0), version=VERSION)
        for name in ("advantages", "returns"):
            want = torch.zeros(LENGTH)
            want[policy] = alone.fields[name]
            assert torch.equal(sample.fields[name], want), name

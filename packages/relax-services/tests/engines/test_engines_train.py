"""Tests of the plain-torch training engine against hand-written references."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import math

import pytest
import torch

from relax_core import AlgorithmConfig, compute_policy_loss, kl_full, masked_mean, value_loss
from relax_services.engines import (
    HFRolloutEngine,
    LossInputs,
    SamplingParams,
    TorchTrainConfig,
    TorchTrainEngine,
    TorchValueEngine,
    TrainEngine,
    TrainSample,
)
from relax_services.engines.sampling import policy_logprobs
from relax_services.models import DEFAULT_SOURCE, OmniPrompt, build_tiny_omni, build_value_model, open_checkpoint
from relax_services.models.synthetic import synthetic_prompt

TOKENS = open_checkpoint(DEFAULT_SOURCE).tokens  # the default checkpoint's ids, read from its tokenizer
SUPPRESSED_IDS = TOKENS.never_sample


def _samples(n: int = 4, seed: int = 0) -> list[TrainSample]:
    """Mixed-modality samples with responses of different lengths and a per-token advantage field."""
    gen = torch.Generator().manual_seed(seed)
    kinds = ["image", "audio", "text", "video"]
    out = []
    for i in range(n):
        prompt = synthetic_prompt(kinds[i % 4], [12 + i, 48], gen)
        response = torch.randint(12, 48, (3 + 2 * i,), generator=gen)
        response[-1] = 2  # eos
        adv = torch.randn(response.shape, generator=gen)
        out.append(TrainSample(prompt, response, {"advantages": adv, "reward": torch.tensor(float(i))}))
    return out


def nll_token_mean(inputs: LossInputs) -> torch.Tensor:
    return -(inputs.logprobs * inputs.mask).sum() / inputs.mask.sum()


def pg_token_mean(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    loss = -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / inputs.mask.sum()
    return loss, {"mean_reward": float(inputs.fields["reward"].mean())}


def pg_sample_mean(inputs: LossInputs) -> torch.Tensor:
    per_sample = (inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum(1) / inputs.mask.sum(1)
    return -per_sample.mean()


def _grads(engine: TorchTrainEngine) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in engine.model.named_parameters() if p.grad is not None}


def test_engine_satisfies_protocol() -> None:
    assert isinstance(
        TorchTrainEngine(build_tiny_omni(0), TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS)), TrainEngine
    )


def test_steps_on_a_supervised_target_decrease_the_loss() -> None:
    engine = TorchTrainEngine(build_tiny_omni(0), TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, lr=1e-2))
    batch = _samples(4)
    losses = [engine.step(batch, nll_token_mean)["loss"] for _ in range(6)]
    assert losses[-1] < 0.7 * losses[0]
    assert all(b < a for a, b in itertools.pairwise(losses))
    assert engine.version == 6
    # No gradient outlives its update: they would hold a model's worth of memory until the next one.
    assert all(p.grad is None for p in engine.model.parameters())


@pytest.mark.parametrize(("loss_fn", "weighting"), [(pg_token_mean, "tokens"), (pg_sample_mean, "samples")])
def test_accumulating_two_micro_batches_equals_one_batch_of_two(loss_fn: object, weighting: str) -> None:
    batch = _samples(2)
    grads = []
    for micro in (2, 1):
        engine = TorchTrainEngine(
            build_tiny_omni(0),
            TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, micro_batch_size=micro, loss_weighting=weighting),  # type: ignore[arg-type]
        )
        metrics = engine.accumulate_gradients(batch, loss_fn)  # type: ignore[arg-type]
        grads.append((_grads(engine), metrics["loss"]))
    (g_full, loss_full), (g_acc, loss_acc) = grads
    assert g_full.keys() == g_acc.keys()
    for name in g_full:
        torch.testing.assert_close(g_acc[name], g_full[name], atol=1e-6, rtol=1e-5, msg=name)
    assert loss_acc == pytest.approx(loss_full, abs=1e-6)


def test_masked_tokens_get_zero_gradient() -> None:
    batch = _samples(2)
    engine = TorchTrainEngine(build_tiny_omni(0), TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, micro_batch_size=8))
    engine.accumulate_gradients(batch, pg_token_mean)
    grads = _grads(engine)
    # Suppressed ids are outside the support: their output rows never receive gradient.
    assert torch.count_nonzero(grads["lm_head.weight"][list(SUPPRESSED_IDS)]) == 0
    assert torch.count_nonzero(grads["lm_head.weight"][[i for i in range(64) if i not in SUPPRESSED_IDS]]) > 0

    # A sample whose response is only padding / suppressed ids adds nothing.
    gen = torch.Generator().manual_seed(9)
    junk = TrainSample(
        synthetic_prompt("image", [20], gen),
        torch.tensor(
            [TOKENS.pad_id, TOKENS.placeholders["image"], TOKENS.pad_id, TOKENS.pad_id, TOKENS.placeholders["audio"]]
        ),
        {"advantages": torch.full((5,), 100.0), "reward": torch.tensor(0.0)},
    )
    engine.model.zero_grad(set_to_none=True)
    engine.accumulate_gradients([batch[0], junk, batch[1]], pg_token_mean)
    for name, g in _grads(engine).items():
        torch.testing.assert_close(g, grads[name], atol=1e-6, rtol=1e-5, msg=name)


def test_trainer_logprobs_match_rollout_behaviour_logprobs() -> None:
    model = build_tiny_omni(0)
    gen = torch.Generator().manual_seed(3)
    prompts = [synthetic_prompt(k, [14, 15], gen) for k in ("text", "image", "video", "audio")]
    params = SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, n=2, max_new_tokens=7, temperature=0.8)
    groups = HFRolloutEngine(model).generate(prompts, params)
    samples = [TrainSample(p, torch.tensor(c.token_ids)) for p, g in zip(prompts, groups, strict=True) for c in g]
    engine = TorchTrainEngine(
        build_tiny_omni(0), TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, temperature=0.8, micro_batch_size=3)
    )
    logprobs, mask = engine.compute_logprobs(samples)
    behaviour = [c.logprobs for g in groups for c in g]
    for i, lp in enumerate(behaviour):
        assert mask[i].sum() == len(lp)
        torch.testing.assert_close(logprobs[i, : len(lp)], torch.tensor(lp), atol=1e-4, rtol=0)


def test_critic_values_are_the_value_head_at_the_columns_that_predict_each_response_token() -> None:
    """Independent reference: one unpadded forward per sample through the decoder, the head at column
    prompt_len - 1 + j; then value regression moves every value toward its target."""
    gen = torch.Generator().manual_seed(4)
    batch = _samples(4)
    critic = build_value_model(build_tiny_omni(0))
    with torch.no_grad():  # a non-zero head, so the check is not 0 == 0
        critic.value_head.weight.normal_(generator=gen)
    engine = TorchValueEngine(critic, TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, lr=3e-3, micro_batch_size=3))
    values, mask = engine.compute_values(batch)
    seen: list[torch.Tensor] = []  # what the LM head reads in a plain forward of the thinker
    hook = critic.thinker.lm_head.register_forward_hook(lambda _m, args, _out: seen.append(args[0]))
    for i, s in enumerate(batch):
        ids = torch.cat([s.prompt.input_ids, s.response_ids])[None]
        with torch.no_grad():
            seen.clear()
            critic.thinker(input_ids=ids, attention_mask=torch.ones_like(ids), **s.prompt.media())
            hidden = seen[0][0]  # [T, H]
            want = critic.value_head(hidden)[s.prompt.num_tokens - 1 : -1, 0]  # [L]
        n = len(s.response_ids)
        assert mask[i, :n].sum() == n
        torch.testing.assert_close(values[i, :n], want, atol=1e-5, rtol=0)
    hook.remove()
    targets = [torch.full((len(s.response_ids),), float(i % 2)) for i, s in enumerate(batch)]
    for s, t, v in zip(batch, targets, values, strict=False):
        s.fields.update(returns=t, old_values=v[: len(t)])

    def regression(inputs: LossInputs) -> torch.Tensor:
        assert inputs.values is not None
        return value_loss(inputs.values, inputs.fields["old_values"], inputs.fields["returns"], inputs.mask, None)[0]

    before = sum(float(((values[i, : len(t)] - t) ** 2).sum()) for i, t in enumerate(targets))
    for _ in range(20):
        engine.step(batch, regression)
    after_values, _ = engine.compute_values(batch)
    after = sum(float(((after_values[i, : len(t)] - t) ** 2).sum()) for i, t in enumerate(targets))
    assert after < 0.1 * before


def test_lr_schedule_warmup_then_cosine() -> None:
    cfg = TorchTrainConfig(
        suppressed_ids=SUPPRESSED_IDS, lr=1.0, warmup_steps=2, schedule="cosine", total_steps=6, min_lr_ratio=0.1
    )
    engine = TorchTrainEngine(build_tiny_omni(0), cfg)
    batch = _samples(1)
    lrs = [engine.step(batch, nll_token_mean)["lr"] for _ in range(7)]
    cos = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(5)]
    assert lrs == pytest.approx([0.5, 1.0, *cos])


def test_linear_schedule_without_warmup() -> None:
    cfg = TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, lr=2.0, schedule="linear", total_steps=4, min_lr_ratio=0.5)
    assert [cfg.lr_factor(k) for k in range(6)] == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5, 0.5])


def test_state_dict_round_trip_continues_identically() -> None:
    batch = _samples(3)
    cfg = TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, lr=1e-3, warmup_steps=3)
    a = TorchTrainEngine(build_tiny_omni(0), cfg)
    for _ in range(2):
        a.step(batch, pg_token_mean)
    saved = a.state_dict()
    published = a.policy_state()
    for _ in range(2):
        a.step(batch, pg_token_mean)
    b = TorchTrainEngine(build_tiny_omni(5), cfg)
    b.load_state_dict(saved)
    assert b.version == 2
    for _ in range(2):
        b.step(batch, pg_token_mean)
    for (name, wa), wb in zip(a.policy_state().items(), b.policy_state().values(), strict=True):
        assert torch.equal(wa, wb), name
    # The published copy did not move with training.
    assert torch.equal(published["lm_head.weight"], saved["model"]["lm_head.weight"])
    assert not torch.equal(published["lm_head.weight"], a.policy_state()["lm_head.weight"])


def test_steps_equal_a_plain_torch_loop() -> None:
    """Independent reference: per-sample unpadded forwards, hand-written log-probs, torch AdamW + clipping."""
    batch = _samples(3)
    # A group: more completions of the first prompt, one sharing the object, one a content-equal copy.
    first = batch[0].prompt
    twin = OmniPrompt(**{k: v.clone() for k, v in {"input_ids": first.input_ids, **first.media()}.items()})
    for prompt, response in ((first, [30, 31, 2]), (twin, [40, 2])):
        fields = {"advantages": torch.tensor([0.5] * len(response)), "reward": torch.tensor(1.0)}
        batch.append(TrainSample(prompt, torch.tensor(response), fields))
    cfg = TorchTrainConfig(
        suppressed_ids=SUPPRESSED_IDS, lr=1e-3, eps=1e-3, grad_clip=0.5, micro_batch_size=2, temperature=0.9
    )
    engine = TorchTrainEngine(build_tiny_omni(0), cfg)
    ref = build_tiny_omni(0).train()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-3, weight_decay=0.0)
    allowed = torch.tensor([i not in SUPPRESSED_IDS for i in range(64)])
    for _ in range(3):
        engine.step(batch, pg_token_mean)
        opt.zero_grad()
        total, count = torch.zeros(()), 0
        for s in batch:
            ids = torch.cat([s.prompt.input_ids, s.response_ids])[None]
            logits = ref(input_ids=ids, attention_mask=torch.ones_like(ids), **s.prompt.media()).logits[0]
            logits = logits[s.prompt.num_tokens - 1 : -1] / 0.9
            logp = torch.log_softmax(logits.masked_fill(~allowed, -math.inf), -1)
            tok = logp.gather(-1, s.response_ids[:, None])[:, 0]  # [L]
            total = total - (tok * s.fields["advantages"]).sum()
            count += len(tok)
        (total / count).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        opt.step()
    for (name, w), w_ref in zip(engine.policy_state().items(), ref.state_dict().values(), strict=True):
        torch.testing.assert_close(w, w_ref, atol=2e-6, rtol=0, msg=name)


def test_minibatches_and_epochs_are_optimizer_steps_within_one_version() -> None:
    """One update with 2 minibatches × 2 epochs equals four single-batch steps on the halves in that order,
    with the LR schedule and the version advancing once."""
    batch = _samples(4)
    cfg = TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, lr=1e-3, warmup_steps=4, grad_clip=0.5, micro_batch_size=1)
    multi = TorchTrainEngine(build_tiny_omni(0), dataclasses.replace(cfg, minibatches=2, epochs=2))
    metrics = multi.step(batch, pg_token_mean)
    assert multi.version == 1 and metrics["version"] == 1.0
    assert metrics["lr"] == pytest.approx(1e-3 / 4)  # the first update's warm-up LR for all four steps
    ref = TorchTrainEngine(build_tiny_omni(0), dataclasses.replace(cfg, warmup_steps=0, lr=1e-3 / 4))
    for half in (batch[:2], batch[2:], batch[:2], batch[2:]):
        ref.step(half, pg_token_mean)
    for (name, w), w_ref in zip(multi.policy_state().items(), ref.policy_state().values(), strict=True):
        torch.testing.assert_close(w, w_ref, atol=1e-7, rtol=0, msg=name)
    assert multi.scheduler.get_last_lr()[0] == pytest.approx(2e-3 / 4)  # one schedule step, not four
    with pytest.raises(ValueError, match="does not split into 2 equal minibatches"):
        multi.step(batch[:3], pg_token_mean)
    with pytest.raises(ValueError, match="minibatches and epochs"):
        TorchTrainConfig(minibatches=0)


def test_config_validation_and_errors() -> None:
    with pytest.raises(ValueError, match="total_steps"):
        TorchTrainConfig(schedule="cosine", total_steps=0)
    with pytest.raises(ValueError, match="loss_weighting"):
        TorchTrainConfig(loss_weighting="mean")  # type: ignore[arg-type]
    engine = TorchTrainEngine(build_tiny_omni(0), TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS))
    assert not engine.autocast_enabled  # CPU
    with pytest.raises(ValueError, match="scalar"):
        engine.step(_samples(1), lambda inputs: inputs.logprobs)
    with pytest.raises(ValueError, match="one entry per response token"):
        TrainSample(_samples(1)[0].prompt, torch.tensor([20, 2]), {"advantages": torch.ones(3)})


def test_forced_bf16_autocast_runs_and_stays_close_to_fp32() -> None:
    batch = _samples(2)
    fp32, _ = TorchTrainEngine(
        build_tiny_omni(0), TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, autocast="off")
    ).compute_logprobs(batch)
    engine = TorchTrainEngine(build_tiny_omni(0), TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, autocast="bf16"))
    assert engine.autocast_enabled
    bf16, mask = engine.compute_logprobs(batch)
    assert bf16.dtype == torch.float32  # log-softmax is taken in float32 whatever the forward dtype
    torch.testing.assert_close(bf16 * mask, fp32 * mask, atol=0.1, rtol=0)
    metrics = engine.step(batch, pg_token_mean)
    assert math.isfinite(metrics["loss"]) and math.isfinite(metrics["grad_norm"])


def _text_samples(seed: int) -> list[TrainSample]:
    """4 text prompts (the first twice, as in a group) with responses of 3–9 tokens, the second one's last token
    a suppressed id (masked out)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [OmniPrompt(torch.randint(12, 48, (5 + i,), generator=gen)) for i in range(3)]
    prompts.insert(1, prompts[0])
    responses = [torch.randint(12, 48, (3 + 2 * i,), generator=gen) for i in range(4)]
    responses[1][-1] = SUPPRESSED_IDS[-1]
    return [
        TrainSample(p, r, {"advantages": torch.randn(r.shape, generator=gen, dtype=torch.float64)})
        for p, r in zip(prompts, responses, strict=True)
    ]


def _dense_logprobs_and_kl(
    model: torch.nn.Module, reference: torch.nn.Module, batch: list[TrainSample], t: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dense computation the engine replaced, written out: per sample one plain forward of the policy and of
    the reference, both whole ``[L_i, V]`` distributions (``policy_logprobs``) and relax-core's ``kl_full`` of
    them. Returns ``(log-probs, KL, mask)``, each ``[B, L]`` zero-padded (KL 0 where masked)."""
    allowed = torch.tensor([i not in SUPPRESSED_IDS for i in range(64)])
    logps, kls, masks = [], [], []
    for s in batch:
        ids = torch.cat([s.prompt.input_ids, s.response_ids[:-1]])[None]  # [1, P + L - 1]
        start = s.prompt.num_tokens - 1  # the column that predicts response token 0
        logits = model(input_ids=ids).logits[0, start:]  # [L, V]
        assert logits.dtype == torch.float64 and float(logits.detach().abs().max()) < 100
        dist = policy_logprobs(logits, t, SUPPRESSED_IDS)  # [L, V]
        with torch.no_grad():
            ref_dist = policy_logprobs(reference(input_ids=ids).logits[0, start:], t, SUPPRESSED_IDS)  # [L, V]
        kept = allowed[s.response_ids]
        logps.append(dist.gather(-1, s.response_ids[:, None])[:, 0])
        kls.append(torch.where(kept, kl_full(dist[None], ref_dist[None], clamp=None)[0], 0.0))
        masks.append(kept.double())
    pad = functools.partial(torch.nn.utils.rnn.pad_sequence, batch_first=True)
    return pad(logps), pad(kls), pad(masks)


def test_a_full_kl_update_equals_the_dense_kl_full_of_plain_forwards() -> None:
    """One update's loss and gradients with ``full_kl`` (the engine's frozen reference, the KL summed over chunks
    of 4 tokens in micro-batches of 3 samples) against :func:`_dense_logprobs_and_kl`: the ``[B, L, V]``
    computation it replaced, on plain unbatched forwards. The weights are float64, but transformers' RMSNorm
    computes in float32 whatever the weights' dtype, so values and gradients passing through the model's 5 norms
    (2 per layer and the final one) carry float32 roundings of relative size u = 2⁻²⁴ ≈ 6·10⁻⁸: the two computations,
    which differ only in summation order (shared prompt cache, chunks, micro-batches), can round apart by a few
    such steps at each norm, well within 10⁻⁶ of the largest value (16 u). The KL term is ≈ 0.05 of the loss
    here and its gradient a like share of the gradients, so a wrong formula, direction or support is far
    outside that (measured: 3·10⁻⁸ of the largest gradient entry)."""
    temperature = 0.7
    cfg = AlgorithmConfig(kl_coef=0.5, kl_estimator="full")
    policy, reference = build_tiny_omni(0).double(), build_tiny_omni(1).double()  # the policy has drifted from it
    dense_policy = copy.deepcopy(policy)
    batch = _text_samples(0)
    logp, kl, mask = _dense_logprobs_and_kl(dense_policy, reference, batch, temperature)  # [B, L] each
    gen = torch.Generator().manual_seed(1)
    old = logp.detach() + 0.05 * torch.randn(logp.shape, generator=gen, dtype=torch.float64)  # ratios near 1
    batch = [
        TrainSample(s.prompt, s.response_ids, {**s.fields, "old_logprobs": old[i, : len(s.response_ids)]})
        for i, s in enumerate(batch)
    ]
    advantages = torch.nn.utils.rnn.pad_sequence([s.fields["advantages"] for s in batch], batch_first=True)
    want, _ = compute_policy_loss(cfg, logp, old, advantages, mask, full_kl=kl)
    want.backward()

    config = TorchTrainConfig(
        suppressed_ids=SUPPRESSED_IDS,
        micro_batch_size=3,
        full_kl=True,
        scoring_chunk_tokens=4,
        autocast="off",
        temperature=temperature,
    )
    engine = TorchTrainEngine(policy, config, reference=copy.deepcopy(reference))
    assert engine.reference is not None and not engine.reference.model.training
    assert not any(p.requires_grad for p in engine.reference.model.parameters())
    kls: list[torch.Tensor] = []

    def loss_fn(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        assert inputs.full_kl is not None and inputs.full_kl.shape == inputs.logprobs.shape
        kls.append(inputs.full_kl.detach())
        return compute_policy_loss(
            cfg,
            inputs.logprobs,
            inputs.fields["old_logprobs"],
            inputs.fields["advantages"],
            inputs.mask,
            full_kl=inputs.full_kl,
        )

    metrics = engine.accumulate_gradients(batch, loss_fn)
    assert len(kls) == 2 and 0.01 < metrics["kl"] < 10  # a KL term of weight (≈ 0.05), below the clamp
    assert metrics["loss"] == pytest.approx(want.item(), abs=1e-6 * max(1.0, abs(want.item())))
    assert metrics["kl"] == pytest.approx(masked_mean(kl.detach(), mask).item(), abs=1e-6)
    grads = _grads(engine)
    dense_grads = {n: p.grad for n, p in dense_policy.named_parameters() if p.grad is not None}
    assert grads.keys() == dense_grads.keys()
    scale = max(float(g.abs().max()) for g in dense_grads.values())
    for name, g in grads.items():
        torch.testing.assert_close(g, dense_grads[name], atol=1e-6 * scale, rtol=0, msg=name)

    # Without full_kl (every loss but the full-vocabulary KL) the engine holds no reference and hands no KL.
    plain = TorchTrainEngine(build_tiny_omni(0).double(), dataclasses.replace(config, full_kl=False))
    assert plain.reference is None
    seen: list[torch.Tensor | None] = []

    def record(inputs: LossInputs) -> torch.Tensor:
        seen.append(inputs.full_kl)
        return -(inputs.logprobs * inputs.mask).sum()

    plain.accumulate_gradients(batch, record)
    assert seen == [None, None]
    with pytest.raises(ValueError, match="full_kl"):
        TorchTrainEngine(build_tiny_omni(0), dataclasses.replace(config, full_kl=False), reference=reference)


def _large_image_samples() -> list[TrainSample]:
    """4 samples whose images have 16 × 16 patches each: enough rows that torch splits the vision tower's
    gradient reductions across intra-op threads."""
    gen = torch.Generator().manual_seed(0)
    side = 16
    out = []
    for _ in range(4):
        ph = TOKENS.placeholders
        ids = [ph["vision_start"], *[ph["image"]] * (side * side // 4), ph["vision_end"], 20]
        prompt = OmniPrompt(
            input_ids=torch.tensor(ids),
            pixel_values=torch.randn(side * side, 3 * 2 * 14 * 14, generator=gen),
            image_grid_thw=torch.tensor([[1, side, side]]),
        )
        allowed = torch.tensor([i for i in range(TOKENS.vocab_size) if i not in SUPPRESSED_IDS])
        response = allowed[torch.randint(len(allowed), (4,), generator=gen)]
        response[-1] = TOKENS.eos_id
        adv = torch.randn(response.shape, generator=gen)
        out.append(TrainSample(prompt, response, {"advantages": adv, "reward": torch.tensor(1.0)}))
    return out


def _update_at(process_threads: int, engine_threads: int | None) -> tuple[dict[str, torch.Tensor], set[int]]:
    """One update in a process at ``process_threads``: the weights, and the thread counts the loss ran under."""
    before = torch.get_num_threads()
    torch.set_num_threads(process_threads)
    seen: set[int] = set()

    def loss(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        seen.add(torch.get_num_threads())
        return pg_token_mean(inputs)

    try:
        engine = TorchTrainEngine(
            build_tiny_omni(0), TorchTrainConfig(micro_batch_size=4, intra_op_threads=engine_threads)
        )
        engine.step(_large_image_samples(), loss)
        return engine.policy_state(), seen
    finally:
        torch.set_num_threads(before)


def test_an_update_gives_the_same_bits_whatever_the_process_thread_count() -> None:
    """The τ = 0 guarantee across processes: the Trainer service and a reference loop in a process started with
    another ``OMP_NUM_THREADS`` must compute the same weights. torch splits large CPU reductions per intra-op
    thread (an unpinned update at 1 and 2 threads gave other vision-tower weights on the omni model built in
    code), so the engine computes at its own fixed count whatever the process's."""
    (one, seen_one), (_, seen_two) = _update_at(1, engine_threads=None), _update_at(2, engine_threads=None)
    assert (seen_one, seen_two) == ({1}, {2})  # control: unpinned, the engine computes at the process's count
    (pinned_one, seen_p1), (pinned_two, seen_p2) = _update_at(1, engine_threads=1), _update_at(2, engine_threads=1)
    assert seen_p1 == seen_p2 == {1}
    assert all(torch.equal(pinned_one[k], pinned_two[k]) for k in pinned_one)
    assert all(torch.equal(pinned_one[k], one[k]) for k in one)
    with pytest.raises(ValueError, match="intra_op_threads"):
        TorchTrainConfig(intra_op_threads=0)


def test_logged_entropy_is_the_token_mean_whatever_the_loss_reports() -> None:
    """The logged entropy is the mean per-token entropy of the policy, computed here from the engine's own
    scores; a loss function that reports an ``entropy`` of its own must not be summed into it (it was:
    H · (1 + 1/tokens), above the entropy's maximum)."""
    engine = TorchTrainEngine(build_tiny_omni(0), TorchTrainConfig(micro_batch_size=2, suppressed_ids=SUPPRESSED_IDS))
    batch = _samples(4)
    with torch.no_grad():
        scores = engine.score(batch)
    expected = float((scores.entropy * scores.mask).sum() / scores.mask.sum())

    def loss_with_own_entropy(inputs: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
        loss, extra = pg_token_mean(inputs)
        return loss, {**extra, "entropy": 3.0, "tokens": 1e6}

    metrics = engine.accumulate_gradients(batch, loss_with_own_entropy)
    assert metrics["entropy"] == pytest.approx(expected, rel=1e-5)
    assert metrics["tokens"] == float(scores.mask.sum())
    assert metrics["entropy"] <= math.log(TOKENS.vocab_size - len(SUPPRESSED_IDS)) + 1e-6

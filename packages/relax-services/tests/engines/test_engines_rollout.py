"""Tests of the built-in rollout engine against plain full forwards of the model."""

from __future__ import annotations

import math
from collections.abc import Mapping

import pytest
import torch

from relax_services.engines import (
    Completion,
    HFRolloutConfig,
    HFRolloutEngine,
    RolloutEngine,
    SamplingParams,
    sample_tokens,
    truncate,
)
from relax_services.models import DEFAULT_SOURCE, OmniPrompt, build_tiny_omni, open_checkpoint
from relax_services.models.synthetic import synthetic_prompt

MODALITIES = ["text", "image", "video", "audio"]

TOKENS = open_checkpoint(DEFAULT_SOURCE).tokens  # the default checkpoint's ids, read from its tokenizer
SUPPRESSED_IDS = TOKENS.never_sample


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build_tiny_omni(seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[OmniPrompt]:
    gen = torch.Generator().manual_seed(0)
    return [synthetic_prompt(kind, [12 + i, 48, 40 + i][: 1 + i % 3], gen) for i, kind in enumerate(MODALITIES * 2)]


def _full_logprobs(model: torch.nn.Module, prompt: OmniPrompt, response: list[int], temperature: float) -> torch.Tensor:
    """Reference: one uncached forward over prompt + response, positions computed by transformers."""
    ids = torch.cat([prompt.input_ids, torch.tensor(response, dtype=torch.long)])[None]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **prompt.media()).logits[0]
    logits = logits[prompt.num_tokens - 1 : -1].double() / temperature  # [L, V] predicting each response token
    logits[:, list(SUPPRESSED_IDS)] = -math.inf
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return logp[torch.arange(len(response)), torch.tensor(response)].float()


def _perturbed_state(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def _check_logprobs(model: torch.nn.Module, prompt: OmniPrompt, c: Completion, temperature: float) -> None:
    ref = _full_logprobs(model, prompt, c.token_ids, temperature)
    torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=1e-4, rtol=0)


def test_engine_satisfies_protocol(model: torch.nn.Module) -> None:
    assert isinstance(HFRolloutEngine(model), RolloutEngine)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(
            suppressed_ids=SUPPRESSED_IDS,
            eos_id=TOKENS.eos_id,
            n=3,
            max_new_tokens=10,
            temperature=0.7,
            top_k=20,
            top_p=0.9,
        )
    ],
)
def test_behaviour_logprobs_equal_a_fresh_full_forward(
    model: torch.nn.Module, prompts: list[OmniPrompt], params: SamplingParams
) -> None:
    groups = HFRolloutEngine(model).generate(prompts, params)
    assert [len(g) for g in groups] == [3] * len(prompts)
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            _check_logprobs(model, prompt, c, params.temperature)
            assert not set(c.token_ids) & set(SUPPRESSED_IDS)
            assert c.versions == [0] * len(c.token_ids)
            # Sampling log-probs are under the truncated distribution: never below the policy's.
            assert all(s >= lp - 1e-6 for s, lp in zip(c.sampling_logprobs, c.logprobs, strict=True))


def test_greedy_with_cache_equals_greedy_without_cache(model: torch.nn.Module, prompts: list[OmniPrompt]) -> None:
    params = SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, n=2, max_new_tokens=8, temperature=0.0)
    groups = HFRolloutEngine(model).generate(prompts, params)
    allowed = torch.tensor([i for i in range(64) if i not in SUPPRESSED_IDS])
    for prompt, group in zip(prompts, groups, strict=True):
        response: list[int] = []
        while len(response) < params.max_new_tokens and (not response or response[-1] != params.eos_id):
            ids = torch.cat([prompt.input_ids, torch.tensor(response, dtype=torch.long)])[None]
            with torch.no_grad():
                logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), **prompt.media()).logits[0, -1]
            response.append(int(allowed[logits[allowed].argmax()]))
        assert group[0].token_ids == response == group[1].token_ids


def test_group_sharing_gives_the_same_samples_as_repeated_prompts(
    model: torch.nn.Module, prompts: list[OmniPrompt]
) -> None:
    params = SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, n=4, max_new_tokens=12)
    shared = HFRolloutEngine(model, HFRolloutConfig(seed=5, share_prompt=True)).generate(prompts, params)
    repeated = HFRolloutEngine(model, HFRolloutConfig(seed=5, share_prompt=False)).generate(prompts, params)
    for gs, gr in zip(shared, repeated, strict=True):
        assert [c.token_ids for c in gs] == [c.token_ids for c in gr]
        for cs, cr in zip(gs, gr, strict=True):
            torch.testing.assert_close(torch.tensor(cs.logprobs), torch.tensor(cr.logprobs), atol=1e-5, rtol=0)
    # Samples within a group differ (the RNG advances per row).
    assert len({tuple(c.token_ids) for c in shared[0]}) > 1


def test_finish_reasons_and_eos(model: torch.nn.Module, prompts: list[OmniPrompt]) -> None:
    biased = build_tiny_omni(seed=0)
    with torch.no_grad():
        biased.lm_head.weight[2] = biased.lm_head.weight[2] + 0.4 * biased.lm_head.weight.abs().mean()
    params = SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, n=8, max_new_tokens=6)
    groups = HFRolloutEngine(biased).generate(prompts, params)
    reasons = {c.finish_reason for g in groups for c in g}
    assert reasons == {"stop", "length"}  # the bias makes both happen
    for c in (c for g in groups for c in g):
        assert (params.eos_id in c.token_ids) == (c.finish_reason == "stop")
        if c.finish_reason == "stop":
            assert c.token_ids.index(params.eos_id) == len(c.token_ids) - 1
        else:
            assert len(c.token_ids) == params.max_new_tokens


class _Poller:
    """Hands out new weights on the ``at``-th poll, then nothing."""

    def __init__(self, state: Mapping[str, torch.Tensor], version: int, at: int) -> None:
        self.state, self.version, self.at, self.calls = state, version, at, 0

    def __call__(self) -> tuple[int, Mapping[str, torch.Tensor]] | None:
        self.calls += 1
        return (self.version, self.state) if self.calls == self.at else None


def _model_with(state: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    m = build_tiny_omni(seed=0)
    m.load_state_dict(dict(state))
    return m


def test_switch_tags_versions_and_recomputes_the_cache(model: torch.nn.Module, prompts: list[OmniPrompt]) -> None:
    new_state = _perturbed_state(model, seed=1)
    new_model = _model_with(new_state)
    params = SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, n=2, max_new_tokens=8, temperature=1.3)
    engine = HFRolloutEngine(build_tiny_omni(seed=0), HFRolloutConfig(partial_rollout="switch"))
    # Poll 1 is at the start of generate, poll k + 1 after decode step k: the switch lands after 3 tokens.
    groups = engine.generate(prompts, params, poll_weights=_Poller(new_state, version=1, at=4))
    assert engine.version == 1
    spanning = 0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            n_old = min(3, len(c.token_ids))
            assert c.versions == [0] * n_old + [1] * (len(c.token_ids) - n_old)
            spanning += c.version_range == (0, 1)
            # Old tokens under the old weights, new tokens under the new weights given the whole prefix.
            old_ref = _full_logprobs(model, prompt, c.token_ids, params.temperature)[:n_old]
            new_ref = _full_logprobs(new_model, prompt, c.token_ids, params.temperature)[n_old:]
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.cat([old_ref, new_ref]), atol=1e-4, rtol=0)
    assert spanning > 0


def test_abort_resume_restarts_unfinished_samples_on_new_weights(
    model: torch.nn.Module, prompts: list[OmniPrompt]
) -> None:
    new_state = _perturbed_state(model, seed=2)
    new_model = _model_with(new_state)
    params = SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, n=2, max_new_tokens=8)
    engine = HFRolloutEngine(build_tiny_omni(seed=0), HFRolloutConfig(partial_rollout="abort_resume"))
    groups = engine.generate(prompts, params, poll_weights=_Poller(new_state, version=3, at=3))
    restarted = 0
    for prompt, group in zip(prompts, groups, strict=True):
        for c in group:
            if c.num_restarts:
                restarted += 1
                assert c.versions == [3] * len(c.token_ids)
                _check_logprobs(new_model, prompt, c, params.temperature)
            else:  # finished within the first 2 steps, on the old weights
                assert len(c.token_ids) <= 2 and c.finish_reason == "stop"
                assert c.versions == [0] * len(c.token_ids)
                _check_logprobs(model, prompt, c, params.temperature)
    assert restarted > 0


def test_finish_old_applies_weights_only_at_the_start(model: torch.nn.Module, prompts: list[OmniPrompt]) -> None:
    engine = HFRolloutEngine(build_tiny_omni(seed=0), HFRolloutConfig(partial_rollout="finish_old"))
    params = SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, n=2, max_new_tokens=6)
    poller = _Poller(_perturbed_state(model, seed=3), version=1, at=2)
    first = engine.generate(prompts, params, poll_weights=poller)
    assert poller.calls == 1 and {v for g in first for c in g for v in c.versions} == {0}
    second = engine.generate(prompts, params, poll_weights=poller)
    assert {v for g in second for c in g for v in c.versions} == {1}


def test_load_weights_refuses_an_older_version(model: torch.nn.Module) -> None:
    engine = HFRolloutEngine(build_tiny_omni(seed=0), version=4)
    with pytest.raises(ValueError, match="newer"):
        engine.load_weights(model.state_dict(), version=3)


def test_released_weights_pin_no_published_version(model: torch.nn.Module, prompts: list[OmniPrompt]) -> None:
    """An engine computing with a published version's arrays (the shared CPU path) holds references to them; after
    ``release_weights`` it holds none (each array's reference count is back to what it was before the load), refuses
    to generate, and after loading the version again generates what it generated before."""
    import sys

    from relax_services.weights.packed import pack_state, unpack_state

    packed = pack_state({k: v.clone() for k, v in _perturbed_state(model, seed=4).items()})
    before = {name: sys.getrefcount(a) for name, a in packed.arrays.items()}
    engine = HFRolloutEngine(build_tiny_omni(seed=0))
    params = SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, n=2, max_new_tokens=6, temperature=0)
    engine.load_weights(unpack_state(packed), version=1)
    assert all(sys.getrefcount(a) > before[name] for name, a in packed.arrays.items())  # the parameters view them
    first = engine.generate(prompts, params)
    assert engine.release_weights() and not engine.release_weights()  # once: nothing is left to drop
    assert {name: sys.getrefcount(a) for name, a in packed.arrays.items()} == before
    assert engine.version == 1
    with pytest.raises(RuntimeError, match="released"):
        engine.generate(prompts, params)
    engine.load_weights(unpack_state(packed), version=1)
    again = engine.generate(prompts, params)
    assert [[c.token_ids for c in g] for g in again] == [[c.token_ids for c in g] for g in first]
    # Weights of its own (copied in: another dtype) are never dropped.
    engine.load_weights({k: v.double() for k, v in model.state_dict().items()}, version=2)
    assert not engine.release_weights()


def test_sampler_matches_hand_computed_truncated_distribution() -> None:
    # Vocabulary of 4 after suppressing nothing: probs 0.5, 0.25, 0.15, 0.10.
    probs = torch.tensor([0.5, 0.25, 0.15, 0.10])
    logits = probs.log()[None].repeat(20_000, 1)
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.7, suppressed_ids=(), eos_id=3)
    # top-k 3 -> {0.5, 0.25, 0.15}/0.9; top-p 0.7: mass before id1 = 0.556 < 0.7 keeps it, before id2 = 0.833 drops it.
    expected = torch.tensor([0.5, 0.25, 0.0, 0.0]) / 0.75
    tokens, logp, samp = sample_tokens(logits, params, torch.rand(20_000, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(tokens, minlength=4).float() / len(tokens)
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)
    torch.testing.assert_close(logp, probs.log()[tokens], atol=1e-6, rtol=0)
    torch.testing.assert_close(samp, expected.log()[tokens], atol=1e-6, rtol=0)
    torch.testing.assert_close(truncate(probs.log()[None], 0, 1.0), probs.log()[None])


def test_sampling_params_validation() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="eos_id"):
        SamplingParams(suppressed_ids=(2,), eos_id=2)
    with pytest.raises(ValueError, match="partial_rollout"):
        HFRolloutConfig(partial_rollout="later")  # type: ignore[arg-type]

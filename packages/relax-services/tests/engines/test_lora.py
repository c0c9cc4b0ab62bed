"""LoRA (``model.lora``) in the torch training engine: only the adapters train, the published weights are the
frozen ones plus ``(alpha / rank) · B A`` computed here by hand, the export is that merged model plus a peft adapter
folder, and a resumed engine continues bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pydantic
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForImageTextToText

from relax_queue import TransferQueue
from relax_services.config import LoraConfig, ModelConfig, load_run_config
from relax_services.control.checkpoint import ENGINE_FILE
from relax_services.control.pipeline import queue_configs
from relax_services.engines import LossInputs, TorchTrainConfig, TorchTrainEngine, TrainSample
from relax_services.engines.registry import RolloutEngineOptions
from relax_services.engines.torch import build_train_engine
from relax_services.engines.vllm import vllm_config
from relax_services.engines.vllm.checkpoint import (
    ENCODER_PREFIXES,
    export_text_decoder,
    is_adapter_key,
    write_peft_adapter,
)
from relax_services.models import DEFAULT_SOURCE, build_tiny_omni, open_checkpoint
from relax_services.models.export import export_checkpoint
from relax_services.models.synthetic import synthetic_prompt
from relax_services.services import TrainerService
from relax_services.services.trainer import publishes_adapters
from relax_services.weights import InProcessWeightStore

SUPPRESSED_IDS = open_checkpoint(DEFAULT_SOURCE).tokens.never_sample
LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
TARGETS = (".q_proj", ".v_proj", ".down_proj")


def _samples(n: int = 4, seed: int = 0) -> list[TrainSample]:
    """Every modality, so the adapters of the audio and vision encoders get gradients too."""
    gen = torch.Generator().manual_seed(seed)
    kinds = ["image", "audio", "text", "video"]
    out = []
    for i in range(n):
        prompt = synthetic_prompt(kinds[i % 4], [12 + i, 48], gen)
        response = torch.randint(12, 48, (3 + 2 * i,), generator=gen)
        response[-1] = 2  # eos
        out.append(TrainSample(prompt, response, {"advantages": torch.randn(response.shape, generator=gen)}))
    return out


def _pg(inputs: LossInputs) -> torch.Tensor:
    return -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / inputs.mask.sum()


def _engine(lora: LoraConfig = LORA, seed: int = 0) -> TorchTrainEngine:
    cfg = TorchTrainConfig(suppressed_ids=SUPPRESSED_IDS, lr=1e-2, grad_clip=0.0, seed=seed, lora=lora)
    return TorchTrainEngine(build_tiny_omni(0), cfg)


def _base_name(adapted_name: str) -> str:
    return adapted_name.replace(".base_layer.", ".")


def _adapted_layers(engine: TorchTrainEngine) -> list[str]:
    """Dotted names (plain model's) of the layers that carry adapters."""
    return sorted(n.removesuffix(".lora_A.default.weight") for n, _ in engine.model.named_parameters() if "lora_A" in n)


def test_only_adapter_parameters_train_and_the_base_weights_keep_their_bits() -> None:
    engine = _engine()
    base = build_tiny_omni(0).state_dict()
    trainable = {n for n, p in engine.model.named_parameters() if p.requires_grad}
    optimised = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert optimised == {id(p) for n, p in engine.model.named_parameters() if n in trainable}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    layers = _adapted_layers(engine)
    assert layers and all(name.endswith(TARGETS) for name in layers)
    # Every linear layer of these names got one, in the decoder and the encoders alike.
    expected = sorted(n for n, m in build_tiny_omni(0).named_modules() if n.endswith(TARGETS))
    assert layers == expected
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for _ in range(3):
        engine.step(_samples(), _pg)
    after = dict(engine.model.named_parameters())
    for name, value in before.items():
        if name in trainable:
            continue
        assert torch.equal(after[name], value), name
        assert torch.equal(after[name], base[_base_name(name)]), name  # and those are the checkpoint's
    changed = [n for n in trainable if not torch.equal(after[n], before[n])]
    assert sorted(changed) == sorted(trainable)  # every adapter saw a gradient (all four modalities)


def test_published_weights_are_base_plus_scaled_BA_under_the_plain_names() -> None:
    engine = _engine()
    for _ in range(2):
        engine.step(_samples(), _pg)
    base = build_tiny_omni(0).state_dict()
    published = engine.policy_state()
    assert list(published) == list(base)  # the plain model's names, in its order: rollout engines load it as is
    params = dict(engine.model.named_parameters())
    scale = LORA.alpha / LORA.rank  # 2.0, a power of two: the scaling itself is exact in float32
    u = 2.0**-24  # float32 unit roundoff
    adapted = {f"{name}.weight" for name in _adapted_layers(engine)}
    for key, value in published.items():
        if key not in adapted:
            assert torch.equal(value, base[key]), key  # not adapted: the frozen bits
            continue
        layer = key.removesuffix(".weight")
        a = params[f"{layer}.lora_A.default.weight"].detach().double()  # [r, in]
        b = params[f"{layer}.lora_B.default.weight"].detach().double()  # [out, r]
        w = base[key].double()  # [out, in]
        exact = w + scale * (b @ a)  # [out, in], float64: exact to ~1e-16 relative
        # float32 B @ A of inner length r errs by at most γ_r Σ_k |B_ik||A_kj| (γ_r = r·u / (1 − r·u)); adding
        # W rounds once more, by at most u·|result|.
        gamma = LORA.rank * u / (1 - LORA.rank * u)
        bound = scale * gamma * (b.abs() @ a.abs()) + u * exact.abs() * (1 + 2 * gamma)
        assert (b != 0).any(), key  # B trained away from zero: the check has something to find
        err = (value.double() - exact).abs()
        assert (err <= bound).all(), (key, float((err - bound).max()))
        assert not torch.equal(value, base[key]), key


def test_checkpoint_holds_adapters_and_a_resumed_engine_continues_bit_for_bit() -> None:
    lora = LORA.model_copy(update={"dropout": 0.25})  # dropout draws from the RNG the checkpoint restores
    batches = [_samples(seed=s) for s in range(4)]
    a = _engine(lora)
    for batch in batches[:2]:
        a.step(batch, _pg)
    saved = a.state_dict()
    assert set(saved["model"]) == {n for n, p in a.model.named_parameters() if p.requires_grad}
    for batch in batches[2:]:
        a.step(batch, _pg)
    # Another seed draws other initial adapters and dropout masks: everything must come from the checkpoint.
    b = _engine(lora, seed=7)
    b.load_state_dict(saved)
    assert b.version == 2
    for batch in batches[2:]:
        b.step(batch, _pg)
    for (name, wa), wb in zip(a.policy_state().items(), b.policy_state().values(), strict=True):
        assert torch.equal(wa, wb), name
    with pytest.raises(ValueError, match=r"model\.lora changed"):
        _engine(LORA.model_copy(update={"target_modules": ["q_proj"]})).load_state_dict(saved)


def test_export_writes_the_merged_model_and_a_peft_adapter(tmp_path: Path) -> None:
    from peft import PeftModel

    engine = _engine()
    for _ in range(2):
        engine.step(_samples(), _pg)
    folder = tmp_path / "checkpoints" / "step_00000002"
    folder.mkdir(parents=True)
    torch.save(engine.state_dict(), folder / ENGINE_FILE)
    out = export_checkpoint(folder, ModelConfig(lora=LORA), tmp_path / "hf")
    merged = engine.policy_state()
    plain = AutoModelForImageTextToText.from_pretrained(out, local_files_only=True)
    loaded = plain.state_dict()
    assert set(loaded) == set(merged)
    for key, value in merged.items():
        assert torch.equal(loaded[key], value), key
    peft_model = PeftModel.from_pretrained(build_tiny_omni(0), out / "adapter")
    adapters = {n.removeprefix("base_model.model."): p for n, p in peft_model.named_parameters() if "lora_" in n}
    trained = {n: p for n, p in engine.model.named_parameters() if p.requires_grad}
    assert set(adapters) == set(trained)
    for name, p in trained.items():
        assert torch.equal(adapters[name], p), name
    assert peft_model.peft_config["default"].r == LORA.rank
    assert peft_model.peft_config["default"].lora_alpha == LORA.alpha


def test_config_errors_name_the_field() -> None:
    with pytest.raises(pydantic.ValidationError, match="rank"):
        ModelConfig.model_validate({"lora": {"rank": 0}})
    with pytest.raises(pydantic.ValidationError, match="target_modules"):
        ModelConfig.model_validate({"lora": {"target_modules": []}})
    with pytest.raises(ValueError, match=r"\['qkv'\] name no linear layer.*'down_proj'.*'q_proj'"):
        _engine(LoraConfig(target_modules=["q_proj", "qkv"]))
    with pytest.raises(ValueError, match="LM head"):
        _engine(LoraConfig(target_modules=["lm_head"], dropout=0.1))
    # The FSDP2 group trains adapters data-parallel (tests/engines/test_engines_fsdp.py); splitting layers is refused.
    assert load_run_config(None, ["model.lora={}", "trainer.world_size=2"]).model.lora == LoraConfig()
    with pytest.raises(ValueError, match=r"model\.lora.*data parallelism only.*trainer\.tensor_parallel=2"):
        load_run_config(None, ["model.lora={}", "trainer.world_size=2", "trainer.tensor_parallel=2"])
    with pytest.raises(ValueError, match=r"model\.lora.*trainer\.sequence_parallel=2 is not supported"):
        load_run_config(None, ["model.lora={}", "trainer.world_size=2", "trainer.sequence_parallel=2"])


def test_run_config_gives_the_trainer_adapters_and_the_reference_the_plain_model() -> None:
    cfg = load_run_config(None, ["model.lora.rank=2", "model.lora.target_modules=[o_proj]"])
    assert cfg.model.lora == LoraConfig(rank=2, target_modules=["o_proj"])
    trainer = build_train_engine(cfg)
    assert trainer.config.lora == cfg.model.lora
    assert {n for n, p in trainer.model.named_parameters() if p.requires_grad} == {
        f"model.layers.{i}.self_attn.o_proj.lora_{ab}.default.weight" for i in range(2) for ab in "AB"
    }
    reference = build_train_engine(cfg, role="reference")
    assert reference.config.lora is None
    assert not any("lora_" in n for n, _ in reference.model.named_parameters())


def _random_adapters(engine: TorchTrainEngine, seed: int) -> None:
    """Non-zero adapters (B starts at zero, which would hide a wrong B in the published form)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in engine.model.parameters():
            if p.requires_grad:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))


def test_adapters_written_for_vllm_load_in_peft_as_the_merged_model(tmp_path: Path) -> None:
    """What vLLM's LoRA requests read (write_peft_adapter over the text-decoder export) is, loaded by peft, the
    model whose weights the merged publication carries: same logits within float32 rounding of x(W + sBA) against
    xW + s(xAᵀ)Bᵀ."""
    from peft import PeftModel
    from transformers import Qwen2ForCausalLM

    engine = _engine()  # adapters on the text decoder and the audio encoder's q_proj / v_proj
    _random_adapters(engine, seed=1)
    adapters = engine.adapter_state()
    folder = write_peft_adapter(adapters, tmp_path / "v1", rank=LORA.rank, alpha=LORA.alpha)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["target_modules"]) == (4, 8, ["down_proj", "q_proj", "v_proj"])
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as f:
        written = set(f.keys())
    text = {n for n in adapters if not n.startswith(ENCODER_PREFIXES)}
    assert len(text) < len(adapters)  # the encoders' adapters are left out
    assert written == {"base_model.model." + n.replace(".default.", ".") for n in text}

    base = Qwen2ForCausalLM.from_pretrained(export_text_decoder(build_tiny_omni(0), tmp_path / "base"))
    served = PeftModel.from_pretrained(base, folder).eval()
    merged = build_tiny_omni(0)
    merged.load_state_dict(engine.policy_state())
    ids = torch.tensor([[1, 12, 40, 20, 33, 17, 25, 14]])
    with torch.no_grad():
        expected = merged(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        got = served(input_ids=ids).logits
        plain = build_tiny_omni(0)(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert (expected - plain).abs().max() > 0.1  # the adapters matter far beyond the tolerance
    published = sum(t.numel() * t.element_size() for t in adapters.values())
    assert published < 0.1 * sum(t.numel() * t.element_size() for t in engine.policy_state().values())


def test_write_peft_adapter_refuses_what_is_not_a_whole_adapter(tmp_path: Path) -> None:
    engine = _engine()
    adapters = engine.adapter_state()
    a_key = next(n for n in adapters if n.startswith("model.") and ".lora_A." in n)
    with pytest.raises(ValueError, match=r"'model.norm.weight' is not an adapter tensor"):
        write_peft_adapter({**adapters, "model.norm.weight": torch.ones(4)}, tmp_path, rank=4, alpha=8)
    with pytest.raises(ValueError, match="only one of lora_A / lora_B"):
        write_peft_adapter({a_key: adapters[a_key]}, tmp_path, rank=4, alpha=8)
    with pytest.raises(ValueError, match=r"expected rank 8 in dimension 0"):
        write_peft_adapter(adapters, tmp_path, rank=8, alpha=8)
    audio = {n: t for n, t in adapters.items() if n.startswith("audio_tower.")}
    with pytest.raises(ValueError, match="no adapter tensors outside"):
        write_peft_adapter(audio, tmp_path, rank=4, alpha=8)


def test_lora_requests_choose_the_publication_form() -> None:
    plain = load_run_config(None, ["model.lora={}", "rollout.engine=vllm"])
    assert not publishes_adapters(plain)  # default: merged weights, today's behaviour
    adapters = load_run_config(None, ["model.lora={}", "rollout.engine=vllm", "rollout.vllm.lora_requests=true"])
    assert publishes_adapters(adapters)
    assert vllm_config(adapters, RolloutEngineOptions(), exported=True).lora_rank == LoraConfig().rank
    assert vllm_config(plain, RolloutEngineOptions(), exported=True).lora_rank is None
    with pytest.raises(ValueError, match=r"rollout\.vllm\.lora_requests.*rollout\.engine='vllm' \(got 'hf'\)"):
        load_run_config(None, ["model.lora={}", "rollout.vllm.lora_requests=true"])
    with pytest.raises(ValueError, match=r"rollout\.vllm\.lora_requests.*model\.lora \(got null\)"):
        load_run_config(None, ["rollout.engine=vllm", "rollout.vllm.lora_requests=true"])


@pytest.mark.parametrize("lora_requests", [False, True])
def test_the_trainer_publishes_adapters_only_for_lora_requests(lora_requests: bool) -> None:
    cfg = load_run_config(
        None,
        ["model.lora.target_modules=[q_proj]", "rollout.engine=vllm", f"rollout.vllm.lora_requests={lora_requests}"],
    )
    store = InProcessWeightStore(keep=1)
    trainer = TrainerService("trainer", cfg, TransferQueue(queue_configs(cfg)[1]), store)
    update = store.fetch()
    assert update is not None and update.version == 0
    if lora_requests:
        assert update.state_dict.keys() == trainer.engine.adapter_state().keys()
        assert all(is_adapter_key(n) for n in update.state_dict)
    else:
        assert update.state_dict.keys() == build_tiny_omni(0).state_dict().keys()

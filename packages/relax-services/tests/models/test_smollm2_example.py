"""The SmolLM2 example (``examples/smollm2``): its GGUF conversion, task files and reward.

The conversion is checked on a tiny GGUF written here with ``gguf``'s own writer from a tiny random Llama and a
byte-level BPE tokenizer (llama.cpp's layout: its tensor names, the q/k row permutation its converter applies, the
tokenizer as metadata): the converted folder must give the source model's logits and the source tokenizer's ids.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch

from relax_core import import_file
from relax_services.models import open_checkpoint

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "smollm2"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CORPUS = ["What is 12+25? Reply with only the number.", "37", "3 + 4 = 7", "You are a helpful assistant."] * 4


def _load(name: str) -> ModuleType:
    return import_file(EXAMPLE / f"{name}.py", f"smollm2_{name}", f"examples/smollm2/{name}.py")


prepare = _load("prepare")
reward = _load("reward")


def _tiny_source():
    """A tiny random Llama (tied embeddings, as SmolLM2's) and a byte-level BPE tokenizer with chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=list(SPECIALS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    return model, tokenizer


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q/k row order (rotary halves interleaved per head); transformers undoes it."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, tokenizer, path: Path) -> Path:
    import gguf

    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(cfg.vocab_size)
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        q, k = sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"]
        writer.add_tensor(f"blk.{i}.attn_q.weight", _permute(q, cfg.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", _permute(k, cfg.num_key_value_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        writer.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    writer.add_tensor("output_norm.weight", sd["model.norm.weight"])  # no output.weight: tied, as llama.cpp writes
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory):
    pytest.importorskip("gguf", reason="the relax-services[gguf] extra is not installed")
    pytest.importorskip("accelerate", reason="the relax-services[gguf] extra is not installed")
    root = tmp_path_factory.mktemp("gguf")
    model, tokenizer = _tiny_source()
    gguf_file = _write_gguf(model, tokenizer, root / "tiny.gguf")
    return model, tokenizer, prepare.convert_gguf(gguf_file, root / "model")


def test_converted_gguf_is_a_llama_folder_with_the_source_logits(converted) -> None:
    source, _, folder = converted
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    ckpt = open_checkpoint(folder)
    assert ckpt.family.name == "llama" and ckpt.tokens.eos_id == 2
    assert set(ckpt.tokens.never_sample) == {0, 1}  # the control tokens but the end of turn
    ids = torch.tensor([[1, 40, 41, 42, 43, 2, 50, 60]])
    with torch.no_grad():
        expected = source(input_ids=ids).logits
        got = ckpt.load_model()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_converted_tokenizer_encodes_and_renders_as_the_source(converted) -> None:
    _, source_tok, folder = converted
    tok = open_checkpoint(folder).tokenizer
    for text in ["What is 12+25? Reply with only the number.", "3 + 4 = 7", "<|im_start|>user\n37<|im_end|>"]:
        assert tok.encode(text, add_special_tokens=False) == source_tok.encode(text, add_special_tokens=False), text
    messages = [{"role": "user", "content": "What is 3+4?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nWhat is 3+4?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_task_files_hold_every_sum_once_with_its_answer(tmp_path: Path) -> None:
    train, held_out = prepare.write_task(tmp_path, eval_size=64)
    rows = {f: [json.loads(line) for line in f.read_text().splitlines()] for f in (train, held_out)}
    assert len(rows[held_out]) == 64 and len(rows[train]) == 20 * 20 - 64  # operands 0-19
    seen = set()
    for row in rows[train] + rows[held_out]:
        question = re.fullmatch(r"What is (\d+)\+(\d+)\? Reply with only the number\.", row["prompt"][-1]["content"])
        assert question is not None, row
        a, b = int(question[1]), int(question[2])
        assert row["reward_model"]["ground_truth"] == str(a + b)
        seen.add((a, b))
    assert seen == {(a, b) for a in range(20) for b in range(20)}  # disjoint halves covering every pair


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        ("22", "22", 1.0),
        (" 22\n", "22", 1.0),
        ("4 + 18 = 22", "22", 1.0),  # SmolLM2's usual reply: the restated question is not the answer
        ("4+18=22.", "22", 1.0),
        ("The answer is 22.", "22", 1.0),
        ("4 + 18 = 21", "22", 0.0),
        ("4 + 18 = 21, no, 22", "22", 0.0),  # the first answer counts, not a later correction
        ("4 + 18", "22", 0.0),  # a restatement alone answers nothing
        ("4 + 18 = 220", "22", 0.0),
        ("4 and 18 make 22", "22", 0.0),  # no "a + b" to skip: its answer is 4
        ("The sum of four and 18 is 22", "22", 0.0),  # "four" is no integer; its answer is 18
        ("-7", "-7", 1.0),
        ("", "3", 0.0),
        ("four", "4", 0.0),
    ],
)
def test_reward_is_one_for_the_sum_as_the_answer_only(response: str, truth: str, expected: float) -> None:
    assert reward.score(response, truth, {}) == expected


def test_example_config_validates_and_scores_with_the_example_reward() -> None:
    from relax_services.config import load_run_config

    cfg = load_run_config(EXAMPLE / "smollm2_arith.yaml")
    assert cfg.reward.fn == f"{EXAMPLE / 'reward.py'}:score"
    assert cfg.data.train_files[0].path.endswith("train.jsonl")

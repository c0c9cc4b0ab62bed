"""LoRA (``model.lora``) against full fine-tuning of the same run config: the Trainer's memory and the reward after
the same updates, side by side.

    python packages/relax-services/benchmarks/lora_vs_full.py [--updates 4] [--lora rank=16,alpha=32] [OVERRIDE ...]
    python packages/relax-services/benchmarks/lora_vs_full.py --config \\
        packages/relax-services/examples/smollm2/smollm2_arith.yaml --updates 8

Memory, per side, from the run config's training engine (``build_train_engine``) on one batch of the run's own
size (``trainer.groups_per_step × algorithm.group_size`` samples of the run's prompts with ``rollout.max_new_tokens``
random response ids; the policy loss without its KL term): the parameters, the trainable ones, AdamW's state, and
the most bytes torch's CPU allocator holds at once during the first update beyond the model itself (gradients,
AdamW's moments, activations), counted exactly from the profiler's records
(:func:`~relax_services.bench.peak_memory.peak_bytes`). Reward: each side runs ``--updates`` updates as a colocated
run (``run.mode=colocated``, the same seeds) and reports the mean sample reward of its first and last update and its
last held-out evaluation's mean over tasks. A run with ``staleness.tau`` > 0 overlaps rollout and training by timing,
so its rewards differ by more than the training does; ``staleness.tau=0`` compares the same sampled prompts. The
default (no ``--config``) is the tiny default run; the SmolLM2 example needs its folder prepared first
(``examples/smollm2/prepare.py``).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch

from relax_services.bench.peak_memory import peak_bytes
from relax_services.config import RunConfig, load_run_config
from relax_services.control.colocated import ColocatedController
from relax_services.data.run_data import prepare_data
from relax_services.engines import TrainSample
from relax_services.engines.torch import build_train_engine
from relax_services.reporting.metrics import read_metrics
from relax_services.services.trainer import make_loss_fn


def _batch(cfg: RunConfig, workdir: Path) -> list[TrainSample]:
    """One update's samples: the run's first prompts, each with ``group_size`` responses of random ids."""
    data = prepare_data(cfg, workdir, build_heldout=False)
    gen = torch.Generator().manual_seed(0)
    length = cfg.rollout.max_new_tokens
    out = []
    for _ in range(cfg.trainer.groups_per_step):
        prompt = data.to_prompt(data.stream.next())
        vocab = int(prompt.input_ids.max()) + 1  # ids the prompt itself uses: valid for any vocabulary
        for _ in range(cfg.algorithm.group_size):
            response = torch.randint(0, vocab, (length,), generator=gen)
            fields = {
                "old_logprobs": torch.full((length,), -1.0),
                "advantages": torch.randn(length, generator=gen),
            }
            out.append(TrainSample(prompt=prompt, response_ids=response, fields=fields))
    return out


def memory(cfg: RunConfig, batch: list[TrainSample]) -> dict[str, float]:
    """Parameter counts and the first update's peak bytes of ``cfg``'s training engine, its loss without the KL
    term (the Reference's log-probs are the same inputs on both sides)."""
    cfg = cfg.model_copy(update={"algorithm": cfg.algorithm.model_copy(update={"kl_coef": 0.0})})
    engine = build_train_engine(cfg)
    params = list(engine.model.parameters())
    loss_fn = make_loss_fn(cfg)
    peak = peak_bytes(lambda: engine.step(batch, loss_fn))
    state = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values())
    return {
        "params": sum(p.numel() for p in params),
        "trainable": sum(p.numel() for p in params if p.requires_grad),
        "param_mb": sum(p.numel() * p.element_size() for p in params) / 1e6,
        "adam_mb": state / 1e6,
        "peak_mb": peak / 1e6,
    }


def reward(cfg: RunConfig, run_dir: Path) -> dict[str, float]:
    """Runs ``cfg`` colocated: the mean sample reward of the first and the last update, and the last held-out
    evaluation's mean over tasks."""
    run_dir.mkdir(parents=True)
    result = ColocatedController(cfg, run_dir).run()
    steps = list(read_metrics(run_dir / "metrics.jsonl", "train"))
    evals = list(read_metrics(run_dir / "metrics.jsonl", "eval"))
    nan = float("nan")
    by_task: dict[str, Any] = evals[-1]["reward"] if evals else {}
    return {
        "updates": float(result.steps),
        "first_reward": float(steps[0]["reward"]) if steps else nan,
        "reward": float(steps[-1]["reward"]) if steps else nan,
        "eval_reward": sum(by_task.values()) / len(by_task) if by_task else nan,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="run config YAML (default: the tiny default run)")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--lora", default="rank=8,alpha=16", help="model.lora fields, comma-separated")
    parser.add_argument("overrides", nargs="*", help="dotted overrides applied to both sides")
    args = parser.parse_args()
    lora = [f"model.lora.{kv}" for kv in args.lora.split(",") if kv]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        common = [
            *args.overrides,
            "run.mode=colocated",
            f"trainer.total_steps={args.updates}",
            f"run.output_dir={work}",
            "model.export_hf=false",
            f"eval.every_steps={args.updates}",
        ]
        sides = {"full": load_run_config(args.config, common), "lora": load_run_config(args.config, [*common, *lora])}
        batch = _batch(sides["full"], work / "data")
        rows = {name: {**memory(cfg, batch), **reward(cfg, work / name)} for name, cfg in sides.items()}
    print(f"{len(batch)} samples per update, {args.updates} updates; MB = 1e6 B; model.lora: {args.lora}")
    head = ("", "params", "trainable", "param MB", "Adam MB", "peak MB", "reward 1st", "last", "eval")
    print(
        f"{head[0]:6} {head[1]:>10} {head[2]:>10} {head[3]:>9} {head[4]:>8} {head[5]:>8} {head[6]:>10} {head[7]:>6} "
        f"{head[8]:>6}"
    )
    for name, r in rows.items():
        print(
            f"{name:6} {r['params']:>10,.0f} {r['trainable']:>10,.0f} {r['param_mb']:>9.2f} {r['adam_mb']:>8.3f} "
            f"{r['peak_mb']:>8.2f} {r['first_reward']:>10.3f} {r['reward']:>6.3f} {r['eval_reward']:>6.3f}"
        )


if __name__ == "__main__":
    main()

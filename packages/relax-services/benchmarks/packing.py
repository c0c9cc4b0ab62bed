"""Padding and seconds per update of the training engine on a GRPO batch of mixed response lengths: micro-batches
by samples or by tokens (``trainer.max_tokens_per_micro_batch``), responses right-padded or packed
(``trainer.packing``).

Run: ``python packages/relax-services/benchmarks/packing.py [--updates 3] [--model wide] [--device cpu]``. The batch
is 8 prompts × 8 completions, prompts of 48 to 128 tokens, response lengths log-normal (median 48, clipped to
[4, 512]: most answers short, a few long, as sampled reasoning answers are). Prints one JSON line per setting:
``padding_frac`` (padding positions the response forwards ran per real response token) and the least and median
``step_s`` over ``--updates`` updates after one warm-up update, the settings taking turns. Measured, never
asserted.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from relax_services.engines import LossInputs, LossResult, TorchTrainConfig, TorchTrainEngine, TrainSample
from relax_services.models import TinyOmniConfig, build_tiny_omni, text_prompt

SHAPES = {
    "tiny": TinyOmniConfig(),
    "wide": TinyOmniConfig(
        hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4, ffn_size=768, mrope_section=(8, 4, 4)
    ),
}
SETTINGS = {
    "16 samples, padded (today)": {"micro_batch_size": 16},
    "16 samples, packed": {"micro_batch_size": 16, "packing": True},
    "2048 tokens, padded": {"max_tokens_per_micro_batch": 2048},
    "2048 tokens, packed": {"max_tokens_per_micro_batch": 2048, "packing": True},
    "4096 tokens, padded": {"max_tokens_per_micro_batch": 4096},
    "4096 tokens, packed": {"max_tokens_per_micro_batch": 4096, "packing": True},
}


def grpo_batch(groups: int = 8, group_size: int = 8, seed: int = 0) -> list[TrainSample]:
    """``groups`` prompts of ``group_size`` rows, response lengths log-normal (median 48, clipped to [4, 512])."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(groups):
        prompt = text_prompt(torch.randint(12, 48, (int(torch.randint(48, 129, (1,), generator=gen)),), generator=gen))
        for _ in range(group_size):
            n = int(torch.exp(torch.randn(1, generator=gen) * 0.9 + 3.87).clamp(4, 512))  # e^3.87 ≈ 48
            response = torch.randint(12, 48, (n,), generator=gen)
            out.append(TrainSample(prompt, response, {"advantages": torch.randn(1, generator=gen).expand(n)}))
    return out


def pg_loss(inputs: LossInputs) -> LossResult:
    """Token-mean policy gradient (units: the unmasked tokens)."""
    units = float(inputs.mask.sum())
    loss = -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / max(units, 1.0)
    return LossResult(loss, units)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--model", choices=sorted(SHAPES), default="wide")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--only", default="", help="only the settings whose name contains this")
    args = parser.parse_args()
    batch = grpo_batch()
    lengths = sorted(len(s.response_ids) for s in batch)
    print(json.dumps({"samples": len(batch), "response_tokens": sum(lengths), "lengths": lengths}))
    chosen = {name: setting for name, setting in SETTINGS.items() if args.only in name}
    engines = {
        name: TorchTrainEngine(
            build_tiny_omni(0, SHAPES[args.model]),
            TorchTrainConfig(lr=1e-5, device=args.device, **setting),  # type: ignore[arg-type]
        )
        for name, setting in chosen.items()
    }
    metrics: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for _ in range(args.updates + 1):  # the settings take turns, so that a load on the machine hits them alike
        for name, engine in engines.items():
            metrics[name].append(engine.step(batch, pg_loss))
    for name, engine in engines.items():
        seconds = [m["step_s"] for m in metrics[name][1:]]
        print(
            json.dumps(
                {
                    "setting": name,
                    "padding_frac": round(metrics[name][0]["padding_frac"], 3),
                    "step_s_min": round(min(seconds), 3),
                    "step_s_median": round(statistics.median(seconds), 3),
                    "micro_batches": len(engine.config.micro_batches(batch)),
                    "loss": metrics[name][0]["loss"],
                }
            )
        )


if __name__ == "__main__":
    main()

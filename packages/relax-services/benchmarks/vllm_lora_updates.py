"""Per policy version with ``model.lora``: the bytes published and the vLLM engine's load seconds when a version is
the merged weights (the default) against the adapters alone served as LoRA requests (``rollout.vllm.lora_requests``).

One tiny Qwen2.5-Omni thinker with the default ``model.lora`` (rank 8, alpha 16, q/k/v/o projections) and random
non-zero adapters per version; the trainer side builds what the Trainer publishes (``merged_state`` or
``adapter_state``, whole policy including the encoders, as the weight store carries it), the vLLM side loads it
(``VLLMRolloutEngine.sync_seconds``: a reload of every decoder weight, or a peft folder written and ``add_lora``),
and decode speed is measured under each form (vLLM's LoRA kernels add work per token). The two engines run one after
the other in this process. Needs vLLM: on CPU run it with the separate environment,

    .venv-vllm/bin/python packages/relax-services/benchmarks/vllm_lora_updates.py --hidden 512 --layers 8

Prints medians over ``--updates`` versions (the first version of each engine is a warm-up and not counted).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from relax_services.config import LoraConfig
from relax_services.engines import SamplingParams
from relax_services.engines.vllm.checkpoint import export_text_decoder
from relax_services.engines.vllm.rollout import VLLMRolloutConfig, VLLMRolloutEngine
from relax_services.models import DEFAULT_SOURCE, TinyOmniConfig, build_tiny_omni, open_checkpoint
from relax_services.models.lora import adapter_state, apply_lora, merged_state
from relax_services.models.synthetic import synthetic_prompt
from relax_services.weights.stores import state_dict_bytes


def _versions(
    model: torch.nn.Module,
    engine: VLLMRolloutEngine,
    publish: Callable[[torch.nn.Module], dict[str, torch.Tensor]],
    updates: int,
    generate: Callable[[], int],
) -> tuple[int, float, float, float]:
    """``(bytes per version, median trainer-side seconds, median vLLM load seconds, tokens/s)``."""
    build, load, rates, num_bytes = [], [], [], 0
    for version in range(1, updates + 2):
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(0.05 * torch.randn(p.shape, generator=gen))
        start = time.perf_counter()
        state = publish(model)
        built = time.perf_counter() - start
        engine.load_weights(state, version)
        start = time.perf_counter()
        tokens = generate()
        rate = tokens / (time.perf_counter() - start)
        if version > 1:  # the first is the warm-up
            build.append(built)
            load.append(engine.sync_seconds[version])
            rates.append(rate)
        num_bytes = state_dict_bytes(state)
    return num_bytes, statistics.median(build), statistics.median(load), statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--updates", type=int, default=5, help="versions timed per form")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per completion")
    args = parser.parse_args()

    config = TinyOmniConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 32,  # head_dim 32, which vLLM's CPU attention takes
        num_kv_heads=max(1, args.hidden // 64),
        ffn_size=2 * args.hidden,
        mrope_section=(8, 4, 4),
    )
    lora = LoraConfig(rank=args.rank, alpha=2 * args.rank)
    tokens = open_checkpoint(DEFAULT_SOURCE).tokens
    params = SamplingParams(
        n=args.n, max_new_tokens=args.tokens, temperature=1.0, suppressed_ids=tokens.never_sample, eos_id=None
    )
    gen = torch.Generator().manual_seed(0)
    prompts = [synthetic_prompt("text", [12 + i % 20, 40 + i % 9, 20 + i % 7], gen) for i in range(args.prompts)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = export_text_decoder(build_tiny_omni(seed=0, config=config), Path(tmp) / "ckpt")
        for form, publish, rank in (("merged", merged_state, None), ("adapters", adapter_state, args.rank)):
            model = apply_lora(build_tiny_omni(seed=0, config=config), lora)
            engine = VLLMRolloutEngine(
                path,
                VLLMRolloutConfig(
                    max_model_len=256, max_num_seqs=256, lora_rank=rank, lora_alpha=None if rank is None else lora.alpha
                ),
            )

            def generate(engine: VLLMRolloutEngine = engine) -> int:
                return sum(len(c.token_ids) for g in engine.generate(prompts, params) for c in g)

            try:
                rows.append((form, *_versions(model, engine, publish, args.updates, generate)))
            finally:
                engine.close()
    n_params = sum(p.numel() for p in build_tiny_omni(seed=0, config=config).parameters())
    print(
        f"model: tiny omni thinker hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.2f} M parameters; "
        f"model.lora rank {args.rank}, q/k/v/o; {args.updates} versions per form; decode {args.prompts} prompts x "
        f"n={args.n} x {args.tokens} tokens, T=1"
    )
    print(f"{'form':<9} {'bytes/version':>14} {'trainer build ms':>17} {'vLLM load ms':>13} {'decode tok/s':>13}")
    for form, num_bytes, build, load, rate in rows:
        print(f"{form:<9} {num_bytes:>14,} {build * 1e3:>17.1f} {load * 1e3:>13.1f} {rate:>13.0f}")
    (_, merged_bytes, _, merged_load, _), (_, adapter_bytes, _, adapter_load, _) = rows
    ratio = adapter_load / merged_load
    print(f"adapters / merged: bytes {adapter_bytes / merged_bytes:.2%}, vLLM load seconds {ratio:.2f}x")


if __name__ == "__main__":
    main()

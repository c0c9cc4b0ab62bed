"""Rollout tokens/s of the vLLM engine against the transformers engine, and weight-update seconds per version.

Both engines drive the same tiny Qwen2.5-Omni thinker (head_dim 32, which vLLM's CPU attention needs; the vLLM
side loads its text decoder exported as a Qwen2 checkpoint), on the same text prompts and sampling parameters,
side by side in one process. Needs vLLM: on CPU run it with the separate environment,

    bash packages/relax-services/scripts/vllm_cpu_env.sh
    .venv-vllm/bin/python packages/relax-services/benchmarks/vllm_rollout.py --prompts 32 --n 8 --tokens 32

Prints the median of ``--repeats`` timed calls after one warm-up call per engine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from relax_services.engines import HFRolloutEngine, SamplingParams
from relax_services.engines.vllm.checkpoint import export_text_decoder
from relax_services.engines.vllm.rollout import VLLMRolloutConfig, VLLMRolloutEngine
from relax_services.models import DEFAULT_SOURCE, OmniPrompt, TinyOmniConfig, build_tiny_omni, open_checkpoint
from relax_services.models.synthetic import synthetic_prompt


def _tokens_per_s(
    engine: HFRolloutEngine | VLLMRolloutEngine, prompts: list[OmniPrompt], params: SamplingParams, repeats: int
) -> float:
    engine.generate(prompts, params)  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        groups = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        rates.append(sum(len(c.token_ids) for g in groups for c in g) / elapsed)
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8, help="completions per prompt")
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--updates", type=int, default=5, help="weight updates timed")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()

    config = TinyOmniConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.hidden // 32,
        num_kv_heads=max(1, args.hidden // 64),
        ffn_size=2 * args.hidden,
        mrope_section=(8, 4, 4),
    )
    thinker = build_tiny_omni(seed=0, config=config)
    gen = torch.Generator().manual_seed(0)
    prompts = [synthetic_prompt("text", [12 + i % 20, 40 + i % 9, 20 + i % 7], gen) for i in range(args.prompts)]
    # Rates count the tokens each engine produced (a completion may stop early at eos).
    tokens = open_checkpoint(DEFAULT_SOURCE).tokens
    params = SamplingParams(
        n=args.n, max_new_tokens=args.tokens, temperature=1.0, suppressed_ids=tokens.never_sample, eos_id=tokens.eos_id
    )

    hf = HFRolloutEngine(thinker)
    hf_rate = _tokens_per_s(hf, prompts, params, args.repeats)

    with tempfile.TemporaryDirectory() as tmp:
        path = export_text_decoder(thinker, Path(tmp) / "ckpt")
        start = time.perf_counter()
        engine = VLLMRolloutEngine(path, VLLMRolloutConfig(max_model_len=256, max_num_seqs=256))
        start_s = time.perf_counter() - start
        vllm_rate = _tokens_per_s(engine, prompts, params, args.repeats)
        states = []
        for v in range(args.updates):
            g = torch.Generator().manual_seed(v)
            states.append({k: t + 0.01 * torch.randn(t.shape, generator=g) for k, t in thinker.state_dict().items()})
        for v, state in enumerate(states, start=1):
            engine.load_weights(state, v)
        hf_sync = []
        for v, state in enumerate(states, start=1):
            t0 = time.perf_counter()
            hf.load_weights(state, v)
            hf_sync.append(time.perf_counter() - t0)

    n_params = sum(p.numel() for p in thinker.parameters())
    print(
        f"model: tiny omni thinker hidden {args.hidden}, {args.layers} layers, {n_params / 1e6:.2f} M parameters; "
        f"{args.prompts} prompts x n={args.n} x {args.tokens} tokens, T=1, {torch.get_num_threads()} torch threads"
    )
    print(f"vLLM engine start: {start_s:.1f} s")
    print(f"transformers engine: {hf_rate:9.0f} tokens/s")
    print(f"vLLM engine:         {vllm_rate:9.0f} tokens/s   ({vllm_rate / hf_rate:.2f}x)")
    sync = list(engine.sync_seconds.values())
    print(
        f"weight update per version: vLLM reload_weights median {statistics.median(sync) * 1e3:.1f} ms "
        f"(min {min(sync) * 1e3:.1f}, max {max(sync) * 1e3:.1f}); "
        f"transformers load_state_dict median {statistics.median(hf_sync) * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()

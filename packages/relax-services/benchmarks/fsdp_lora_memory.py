"""Memory per rank of one FSDP2 update, LoRA (``model.lora``'s defaults) against full fine-tuning, on 2 gloo ranks.

    python packages/relax-services/benchmarks/fsdp_lora_memory.py [--hidden 512] [--layers 4] [--ranks 2]

Both sides train the same omni thinker, built from a config (text width ``--hidden``, ``--layers`` decoder blocks, the
tiny model's encoders and vocabulary), on the same batch of 8 text samples (4 per rank, one micro-batch each). Per
rank: the parameters' local shard, AdamW's state after the update, and the most bytes torch's CPU allocator held at
once during the first update beyond what it held before (gradients, AdamW's moments, gathered blocks, activations),
counted exactly from the profiler's records (:func:`~relax_services.bench.peak_memory.peak_bytes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import subprocess
import sys
import tempfile

import torch


def _batch() -> list[object]:
    from relax_services.engines import TrainSample
    from relax_services.models.synthetic import synthetic_prompt

    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        response = torch.randint(12, 48, (16 + i,), generator=gen)
        adv = torch.randn(response.shape, generator=gen)
        out.append(TrainSample(synthetic_prompt("text", [12 + i, 40], gen), response, {"advantages": adv}))
    return out


def _pg(inputs: object) -> torch.Tensor:
    from relax_services.engines import LossInputs

    assert isinstance(inputs, LossInputs)
    return -(inputs.logprobs * inputs.fields["advantages"] * inputs.mask).sum() / inputs.mask.sum()


def _local_bytes(tensors: list[torch.Tensor]) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() * t.element_size() for t in tensors)


def rank_main(rank: int, world: int, store: str, hidden: int, layers: int) -> None:
    """One rank: both sides, one line each."""
    import torch.distributed as dist

    from relax_services.bench.peak_memory import peak_bytes
    from relax_services.config import LoraConfig
    from relax_services.engines import TorchTrainConfig
    from relax_services.engines.fsdp.train import FSDPTrainEngine
    from relax_services.models import build_tiny_omni
    from relax_services.models.tiny_omni import TinyOmniConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    heads = hidden // 64  # head dim 64: rotary half-dims 32 = (16, 8, 8)
    model_cfg = TinyOmniConfig(
        hidden_size=hidden,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=max(1, heads // 2),
        ffn_size=hidden * 11 // 4,
        mrope_section=(16, 8, 8),
    )
    full = TorchTrainConfig(lr=1e-3, micro_batch_size=4)
    batch = _batch()
    for name, cfg in (("full", full), ("lora", dataclasses.replace(full, lora=LoraConfig()))):
        engine = FSDPTrainEngine(build_tiny_omni(0, model_cfg), cfg)
        params = list(engine.model.parameters())
        trainable = sum(p.numel() for p in params if p.requires_grad)
        peak = peak_bytes(functools.partial(engine.step, batch, _pg))
        moments = [v for s in engine.optimizer.state.values() for v in s.values() if v.dim() > 0]
        mib = 2**20
        print(
            f"rank {rank}  {name:4s}  {sum(p.numel() for p in params):>12,}  {trainable:>11,}  "
            f"{_local_bytes(params) / mib:>10.1f}  {_local_bytes(moments) / mib:>8.2f}  {peak / mib:>12.1f}",
            flush=True,
        )
        del engine
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512, help="text width (a multiple of 64)")
    parser.add_argument("--layers", type=int, default=4, help="text decoder blocks")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks (processes)")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        rank_main(args.rank, args.ranks, args.store, args.hidden, args.layers)
        return
    print("rank    side        params    trainable  shard MiB  Adam MiB  peak MiB (1st update)")
    with tempfile.TemporaryDirectory() as tmp:
        common = [f"--hidden={args.hidden}", f"--layers={args.layers}", f"--ranks={args.ranks}", f"--store={tmp}/s"]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        procs = [
            subprocess.Popen([sys.executable, __file__, f"--rank={r}", *common], env=env, stderr=subprocess.DEVNULL)
            for r in range(args.ranks)
        ]
        codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


if __name__ == "__main__":
    main()

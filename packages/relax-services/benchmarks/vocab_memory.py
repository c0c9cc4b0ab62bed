"""Peak memory of one training update at V = 4,096 / 32,768 / 151,936 (hidden 64, 2 layers, the same 8 × 256
response tokens): the sampled-token KL (k3) beside the exact full-vocabulary KL (``algorithm.kl_estimator=full``),
both scored a chunk of tokens at a time, each peak less 4× the embedding and LM head bytes (gradients, Adam's m and
v, its sqrt(v) temporary), and the full KL engine's frozen reference's embedding and LM head (held before and after
the step). Exact counts of torch's CPU allocations (profiler records), not timings.

    python packages/relax-services/benchmarks/vocab_memory.py [--vocab 4096 32768 151936] [--device cpu|cuda]

On ``--device cuda`` the peaks are the CUDA allocator's (``torch.cuda.max_memory_allocated``), the step under bf16
autocast over float32 weights as a GPU run trains.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from relax_services.bench.vocab_memory import HIDDEN, VocabMemory, Workload, format_table, measure_vocab


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[4096, 32768, 151936])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: the CUDA allocator's peak")
    args = parser.parse_args()
    work = Workload()
    rows: list[VocabMemory] = []
    with tempfile.TemporaryDirectory() as workdir:
        if args.device == "cuda":  # the process's first CUDA step allocates cuBLAS workspaces it keeps: not counted
            measure_vocab(args.vocab[0], Path(workdir) / "warm-up", work, args.device)
        for vocab in args.vocab:
            rows.append(measure_vocab(vocab, Path(workdir), work, args.device))
    batch = work.prompts * work.group_size
    print(
        f"{args.device}: hidden {HIDDEN}, 2 layers; {batch} samples × {work.response_tokens} response tokens "
        f"({work.prompts} prompts of {work.prompt_tokens}), LM-head chunks of {work.chunk_tokens} tokens; MB = 1e6 B"
    )
    print(format_table(rows))


if __name__ == "__main__":
    main()

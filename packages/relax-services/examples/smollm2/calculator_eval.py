"""Held-out reward and tool-call rate of the calculator example, for a checkpoint folder (the prepared SmolLM2, or
a trained one written by ``relax export``), run as the training run's episodes are: the same environment, the same
episode runner and bounds, on the transformers engine.

    python packages/relax-services/examples/smollm2/calculator_eval.py --model runs/smollm2/model \\
        --rows runs/smollm2/calc_eval.jsonl [--samples 4] [--no-tool]

Prints, for greedy decoding and for ``--samples`` samples per row at temperature 1 (the training distribution):
the mean reward, the share of episodes with a tool call, and the mean turns. ``--no-tool`` asks the same questions
with the plain system prompt and one turn: the model's own multiplication, the baseline the tool has to beat.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from calculator import score  # noqa: E402


def _rows(path: Path, no_tool: bool) -> list[dict[str, object]]:
    rows = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
        row = json.loads(line)
        messages = row["prompt"]
        if no_tool:
            question = messages[-1]["content"]
            messages = [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"{question} Reply with only the number."},
            ]
        rows.append({"id": i, "messages": messages, "ground_truth": row["reward_model"]["ground_truth"]})
    return rows


def evaluate(model_dir: Path, rows: list[dict[str, object]], samples: int, max_turns: int) -> dict[str, object]:
    """Greedy and sampled reward, tool-call share and mean turns over ``rows``."""
    from relax_services.agents import AgentConfig, EpisodeRunner, load_environment
    from relax_services.engines import HFRolloutConfig, HFRolloutEngine, SamplingParams
    from relax_services.models import open_checkpoint
    from relax_services.models.checkpoint import load_model
    from relax_services.services.reward import decode_response

    ckpt = open_checkpoint(model_dir)
    engine = HFRolloutEngine(load_model(ckpt.path), HFRolloutConfig(seed=0, intra_op_threads=1))
    env = load_environment(f"{HERE / 'calculator.py'}:Calculator")
    config = AgentConfig(max_turns=max_turns, max_new_tokens=48, max_episode_tokens=160)
    out: dict[str, object] = {"rows": len(rows)}
    for name, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, samples)):
        params = SamplingParams(
            eos_id=ckpt.tokens.eos_id, suppressed_ids=ckpt.tokens.never_sample, temperature=temperature
        )
        with EpisodeRunner(engine, env, ckpt.tokenizer, ckpt.family, params, config) as runner:
            groups = runner.run_sync(rows, group_size=n)
        episodes = [(row, ep) for row, group in zip(rows, groups, strict=True) for ep in group]
        rewards = [
            score(decode_response(ep.token_ids, ckpt.tokenizer), str(row["ground_truth"]), {}) for row, ep in episodes
        ]
        out[name] = {
            "reward": sum(rewards) / len(rewards),
            "tool_call_rate": sum(ep.counters.tool_calls > 0 for _, ep in episodes) / len(episodes),
            "tool_errors": sum(ep.counters.tool_errors for _, ep in episodes),
            "turns_mean": sum(ep.counters.turns for _, ep in episodes) / len(episodes),
            "episodes": len(episodes),
            "example": decode_response(episodes[0][1].token_ids, ckpt.tokenizer),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder")
    parser.add_argument("--rows", type=Path, required=True, help="the calculator task's held-out JSONL")
    parser.add_argument("--samples", type=int, default=4, help="samples per row at temperature 1")
    parser.add_argument("--limit", type=int, default=None, help="the first this many rows only")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--no-tool", action="store_true", help="plain prompt, one turn: the model's own arithmetic")
    args = parser.parse_args(argv)
    rows = _rows(args.rows, args.no_tool)[: args.limit]
    print(json.dumps(evaluate(args.model, rows, args.samples, 1 if args.no_tool else args.max_turns), indent=1))


if __name__ == "__main__":
    main()

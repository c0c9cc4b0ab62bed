"""Episodes on the real transformers engine with the default tiny model, of an environment (``rollout.env``) and of a
black-box agent (``rollout.agent``): every assistant token's behaviour log-prob equals a plain transformers forward of
the whole conversation (prompt, sampled turns and environment turns) at its position, environment tokens have mask
0, log-prob 0 and the version before them."""

from __future__ import annotations

import copy
import math

import torch

from relax_services.agents import AgentConfig, AgentRunner, Episode, EpisodeRunner, load_agent, load_environment
from relax_services.engines import HFRolloutConfig, HFRolloutEngine, SamplingParams, TorchTrainConfig, TorchTrainEngine
from relax_services.engines.protocols import TrainSample
from relax_services.models import DEFAULT_SOURCE, build_tiny_omni, open_checkpoint

STEP_ENV = """
class Env:
    def reset(self, row):
        self.turn = 0
        return [{"role": "user", "content": row["q"]}]

    def step(self, assistant_message):
        self.turn += 1
        return [{"role": "user", "content": "again " + str(self.turn)}], None, self.turn == 3
"""

VERSION = 2
U32 = 2.0**-24  # float32 unit roundoff


def _tolerance(model: torch.nn.Module, max_len: int, max_abs_logit: float) -> float:
    """First-order float32 rounding bound of a log-prob (Higham, *Accuracy and Stability of Numerical Algorithms*,
    §3.1: a sum of k rounded terms is within k·u of exact relative to the sum of the terms' magnitudes): the longest
    chain of rounded operations a log-prob depends on is K = layers·(4H + I + T) + H + V (per layer the q/k/v/o
    projections, the MLP, the attention sum over T positions; the LM head; the log-sum-exp over V), each relative
    to magnitudes bounded by Λ = 2·max|logit| + log V; so |Δ log p| ≤ K·u·(1 + Λ)."""
    cfg = model.config.get_text_config()
    k = cfg.num_hidden_layers * (4 * cfg.hidden_size + cfg.intermediate_size + max_len)
    k += cfg.hidden_size + cfg.vocab_size
    lam = 2 * max_abs_logit + math.log(cfg.vocab_size)
    return k * U32 * (1 + lam)


def test_assistant_logprobs_equal_a_forward_of_the_whole_conversation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ckpt = open_checkpoint(DEFAULT_SOURCE)
    path = tmp_path / "step_env.py"
    path.write_text(STEP_ENV)
    env = load_environment(f"{path}:Env")
    model = build_tiny_omni(seed=0)
    reference = copy.deepcopy(model).double().eval()
    tok = ckpt.tokenizer
    # Only the eos and four characters may be sampled, so the random model ends its turns within a few tokens.
    keep = {ckpt.tokens.eos_id, *(tok.convert_tokens_to_ids(c) for c in "abcd")}
    suppressed = tuple(i for i in range(ckpt.tokens.vocab_size) if i not in keep)
    params = SamplingParams(eos_id=ckpt.tokens.eos_id, suppressed_ids=suppressed, temperature=0.9)
    engine = HFRolloutEngine(model, HFRolloutConfig(seed=0), version=VERSION)
    config = AgentConfig(max_turns=3, max_new_tokens=12, max_episode_tokens=200)
    rows = [{"q": f"what is {i}+{i}?"} for i in range(3)]
    with EpisodeRunner(engine, env, tok, ckpt.family, params, config) as runner:
        groups = runner.run_sync(rows, group_size=2)

    episodes = [ep for group in groups for ep in group]
    assert sum(ep.counters.turns for ep in episodes) > len(episodes)  # some episodes went on past their first turn
    _check_against_a_forward(episodes, reference, params, suppressed)
    # The Trainer scores the samples as the rollout did: the environment's turns (the template's special tokens among
    # them, ids the policy never samples) are fed as they are, not as padding.
    trainer = TorchTrainEngine(copy.deepcopy(model), TorchTrainConfig(temperature=0.9, suppressed_ids=suppressed))
    trained, _ = trainer.compute_logprobs(
        [TrainSample(ep.sample_prompt(), torch.tensor(ep.token_ids)) for ep in episodes]
    )
    for i, ep in enumerate(episodes):
        policy = torch.tensor(ep.mask, dtype=torch.bool)
        got = trained[i, : len(ep.token_ids)].double()[policy]
        ids = torch.tensor(ep.prompt_ids + ep.token_ids)[None]
        with torch.no_grad():
            max_logit = float(reference(input_ids=ids).logits.abs().max()) / params.temperature
        # Two float32 computations, each within the bound of the float64 forward: within twice it of each other.
        tol = 2 * _tolerance(reference, ids.shape[1], max_logit)
        assert float((got - torch.tensor(ep.logprobs, dtype=torch.float64)[policy]).abs().max()) <= tol


def _check_against_a_forward(
    episodes: list[Episode], reference: torch.nn.Module, params: SamplingParams, suppressed: tuple[int, ...]
) -> None:
    """Each assistant token's behaviour log-prob equals the float64 forward's within the float32 bound; the
    environment's tokens have mask 0, log-prob 0; every token the engine's version."""
    errors = []
    for ep in episodes:
        n = len(ep.token_ids)
        assert len(ep.logprobs) == len(ep.versions) == len(ep.mask) == n > 0
        assert ep.versions == [VERSION] * n
        assert ep.counters.env_tokens == ep.mask.count(0)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.mask, strict=True) if m == 0)
        ids = torch.tensor(ep.prompt_ids + ep.token_ids)[None]  # [1, P + L]
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, len(ep.prompt_ids) - 1 : -1]  # [L, V] predicting each token
        scaled = logits / params.temperature
        scaled[:, list(suppressed)] = -math.inf
        logp = torch.log_softmax(scaled, dim=-1)  # [L, V] float64
        expected = logp[torch.arange(n), torch.tensor(ep.token_ids)]  # [L]
        policy = torch.tensor(ep.mask, dtype=torch.bool)
        got = torch.tensor(ep.logprobs, dtype=torch.float64)
        tol = _tolerance(reference, ids.shape[1], float(logits.abs().max()) / params.temperature)
        errors.append((float((got - expected)[policy].abs().max()), tol))
    for err, tol in errors:
        assert err <= tol, errors


AGENT = """
async def run(task, client):
    messages = [{"role": "user", "content": task["q"]}]
    for turn in range(3):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=12)
        if reply.choices[0].finish_reason == "length":
            break
        messages += [reply.choices[0].message, {"role": "user", "content": "again " + str(turn + 1)}]
"""


def test_a_black_box_agents_logprobs_equal_a_forward_of_the_whole_conversation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The same check for ``rollout.agent``: the ``openai`` client's three calls per episode, each re-sending the
    conversation, assembled into one episode whose tokens the engine scored exactly."""
    ckpt = open_checkpoint(DEFAULT_SOURCE)
    path = tmp_path / "agent.py"
    path.write_text(AGENT)
    model = build_tiny_omni(seed=0)
    reference = copy.deepcopy(model).double().eval()
    tok = ckpt.tokenizer
    keep = {ckpt.tokens.eos_id, *(tok.convert_tokens_to_ids(c) for c in "abcd")}
    suppressed = tuple(i for i in range(ckpt.tokens.vocab_size) if i not in keep)
    params = SamplingParams(eos_id=ckpt.tokens.eos_id, suppressed_ids=suppressed, temperature=0.9)
    engine = HFRolloutEngine(model, HFRolloutConfig(seed=0), version=VERSION)
    config = AgentConfig(max_turns=3, max_new_tokens=12, max_episode_tokens=200)
    rows = [{"q": f"what is {i}+{i}?"} for i in range(3)]
    with AgentRunner(engine, load_agent(f"{path}:run"), tok, ckpt.family, params, config) as runner:
        groups = runner.run_sync(rows, group_size=2)

    episodes = [ep for group in groups for ep in group]
    assert all(ep.error is None and ep.counters.prefix_breaks == 0 for ep in episodes)
    assert sum(ep.counters.turns for ep in episodes) > len(episodes)  # some episodes went on past their first turn
    _check_against_a_forward(episodes, reference, params, suppressed)

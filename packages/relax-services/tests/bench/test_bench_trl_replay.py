"""``relax bench trl --check-updates``: relax's trainer step replayed on a captured update, against an update
computed here independently the way TRL's ``GRPOTrainer`` computes it (TRL itself is never a dependency)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from relax_services.bench import trl as bench_trl
from relax_services.bench.trl_replay import UpdateCheck, format_checks, replay_update
from relax_services.config import load_run_config

GROUP = 4
LR = 1e-3


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bench's model folder and task, as ``relax bench trl`` writes them."""
    folder = tmp_path_factory.mktemp("bench")
    bench_trl._write_model(folder, seed=0)
    bench_trl._write_task(folder, bench_trl._hparams(4, 0, folder))
    return folder


def _batch(work: Path) -> tuple[torch.Tensor, torch.Tensor, list[str], list[float]]:
    """Two prompts × GROUP one-token completions: prompt ids [B, P], completion ids [B, 1], answers, rewards."""
    tok = PreTrainedTokenizerFast.from_pretrained(str(work / "model"))
    task = json.loads((work / "task.json").read_text(encoding="utf-8"))
    prompts, answers = task["prompts"][:2], task["answers"][:2]
    # first prompt: one of four right (mean 1/4, unbiased std 1/2); second: two of four
    picks = [[answers[0], "9", "9", "+"], [answers[1], answers[1], "=", "9"]]
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    if answers[0] == "9" or answers[1] == "9":
        raise AssertionError("the hand-picked wrong answers assume no answer is 9")
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    prompt_ids = torch.tensor([ids[g] for g in range(2) for _ in range(GROUP)])
    completion_ids = torch.tensor([[tok.convert_tokens_to_ids(t)] for group in picks for t in group])
    return prompt_ids, completion_ids, [a for a in answers for _ in range(GROUP)], rewards


def _trl_style_update(work: Path, lr: float = LR, loss_scale: float = 1.0) -> dict[str, Any]:
    """One update as TRL 1.16 computes it (``loss_type="grpo"``, β = 0, one step per batch), written from its
    formulas: log-probs over the whole vocabulary, (r − group mean) / (unbiased group std + 1e-4), the
    per-sequence token mean of −A·ratio, the batch mean, clipping the global norm to 1, AdamW. A first update
    on the same batch gives Adam a state; the second is captured as TRL's side saves it."""
    model = AutoModelForCausalLM.from_pretrained(str(work / "model"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    prompt_ids, completion_ids, answers, rewards = _batch(work)
    r = torch.tensor(rewards).view(-1, GROUP)  # [G, n]
    advantages = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).reshape(-1)  # [B]
    capture: dict[str, Any] = {}
    for update in range(2):
        if update == 1:
            capture["before"] = copy.deepcopy(model.state_dict())
            names = {id(p): n for n, p in model.named_parameters()}
            capture["adam"] = {names[id(p)]: copy.deepcopy(s) for p, s in optimizer.state.items()}
        optimizer.zero_grad()
        logits = model(torch.cat([prompt_ids, completion_ids], 1)).logits[:, prompt_ids.shape[1] - 1]  # [B, V]
        logp = torch.log_softmax(logits, -1).gather(1, completion_ids)  # [B, 1]
        ratio = torch.exp(logp - logp.detach())
        loss = (-(ratio * advantages[:, None]).mean(-1)).mean() * loss_scale
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    capture.update(
        step=1,
        prompt_ids=prompt_ids,
        prompt_mask=torch.ones_like(prompt_ids),
        completion_ids=completion_ids,
        completion_mask=torch.ones_like(completion_ids),
        advantages=advantages,
        answers=answers,
        grads=grads,
        after=copy.deepcopy(model.state_dict()),
    )
    return capture


def _cfg(work: Path) -> Any:
    return load_run_config(None, bench_trl.relax_overrides(work, bench_trl._hparams(4, 0, work), tau=0))


def test_relax_step_matches_an_update_computed_the_way_trl_computes_it(work: Path) -> None:
    check = replay_update(_trl_style_update(work), _cfg(work))
    assert check.matches
    assert check.reward == pytest.approx(3 / 8)
    # Only the group-std ε differs (TRL 1e-4, relax-core 1e-6): the right answer of the first group has advantage
    # 0.75 / (0.5 + ε), so the two differ by 0.75 · (1e-4 − 1e-6) / 0.5² (to first order).
    assert check.advantage_diff == pytest.approx(0.75 * (1e-4 - 1e-6) / 0.25, rel=1e-2)
    assert check.grad_norm_relax == pytest.approx(check.grad_norm_trl, rel=1e-3)
    assert check.weight_diff < 0.1 * check.weight_step


def test_a_different_learning_rate_or_loss_scale_does_not_match(work: Path) -> None:
    cfg = _cfg(work)
    faster = replay_update(_trl_style_update(work, lr=2 * LR), cfg)
    assert not faster.matches
    assert faster.weight_diff > 0.3 * faster.weight_step  # half of TRL's step is missing in some tensor
    doubled = replay_update(_trl_style_update(work, loss_scale=2.0), cfg)
    assert not doubled.matches  # Adam hides a loss scale in the weights; the gradients show it
    assert doubled.grad_norm_trl == pytest.approx(2 * doubled.grad_norm_relax, rel=1e-3)


def test_a_capture_without_completion_tokens_is_rejected_by_row(work: Path) -> None:
    capture = _trl_style_update(work)
    capture["completion_mask"] = capture["completion_mask"].clone()
    capture["completion_mask"][3] = 0
    with pytest.raises(ValueError, match="captured update 1: row 3 has no completion token"):
        replay_update(capture, _cfg(work))


def test_table_marks_each_update() -> None:
    same = UpdateCheck(0, 0.5, 1e-3, 0.42, 0.42, 3e-5, 8e-2, 4e-5, 1e-3, "lm_head.weight")
    other = UpdateCheck(5, 0.5, 1e-3, 0.42, 0.84, 3e-2, 8e-2, 4e-4, 1e-3, "lm_head.weight")
    table = format_checks([same, other]).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| 0 |") and table[2].endswith("| yes |")
    assert table[3].startswith("| 5 |") and table[3].endswith("| NO |")

"""``relax bench trl --check-updates``: one TRL update replayed through relax's trainer step.

TRL's side saves chosen updates at their boundary (``benchmarks/trl_side.py --capture-steps``): the batch it trained
on (prompt and completion ids and masks, advantages, each row's answer), the weights and Adam state before, the
gradients before clipping and the weights after. :func:`replay_update` feeds exactly that batch to what relax's
Trainer runs for one update — the run config's training engine (:func:`~relax_services._policy.build_train_engine`),
:func:`~relax_services.services.trainer.build_train_samples` (rewards by relax's reward decoding, GRPO advantages)
and :func:`~relax_services.services.trainer.make_loss_fn` — from the same weights and Adam state, and measures how
far the two updates are apart: advantages, gradients before clipping, their global norm and the weights after.

Two updates alike to float rounding differ in the weights after by a small fraction of the update itself and in
the gradients by a small fraction of the largest one; a different objective moves them apart by the order of the
update (another learning rate, clipping elsewhere) or of the gradient (a scaled or differently aggregated loss,
which Adam's normalisation would hide in the weights). :attr:`UpdateCheck.matches` draws the lines at a tenth of
TRL's own step in every tensor and a hundredth of its largest gradient.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypedDict

import torch

from relax_core import exact_match_reward

if TYPE_CHECKING:
    from relax_services.config import RunConfig
    from relax_services.engines import TorchTrainEngine
    from relax_services.models.decoder import Decoder
    from relax_services.rows import SampleRow

__all__ = ["GRAD_MATCH_FRACTION", "MATCH_FRACTION", "Capture", "UpdateCheck", "format_checks", "replay_update"]


class Capture(TypedDict):
    """One ``step<NNNN>.pt`` that ``benchmarks/trl_side.py --capture-steps`` saves at a TRL update's boundary."""

    step: int
    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C]
    completion_mask: torch.Tensor  # [B, C]
    advantages: torch.Tensor  # [B]
    answers: list[str]
    before: dict[str, torch.Tensor]
    adam: dict[str, dict[str, torch.Tensor]]
    grads: dict[str, torch.Tensor]
    after: dict[str, torch.Tensor]


MATCH_FRACTION = 0.1
"""Updates match when relax's weights after are within this fraction of TRL's own step, tensor by tensor."""
GRAD_MATCH_FRACTION = 0.01
"""... and relax's gradients before clipping within this fraction of TRL's largest gradient element (the two
group-std ε, TRL's 1e-4 and relax-core's 1e-6, alone differ by 4e-4 of an advantage when a group's std is 0.25)."""


@dataclass(frozen=True)
class UpdateCheck:
    """One captured TRL update against relax's update on the same batch from the same state.

    Attributes:
        step: The update (0-based, TRL's ``global_step`` before it).
        reward: Mean reward of the batch (relax's reward of the completions).
        advantage_diff: Largest ``|relax − TRL|`` advantage over the rows.
        grad_norm_trl: TRL's global gradient norm before clipping.
        grad_norm_relax: relax's global gradient norm before clipping.
        grad_diff: Largest ``|relax − TRL|`` gradient element before clipping.
        grad_max: Largest ``|TRL gradient|`` element (the scale of ``grad_diff``).
        weight_diff: Largest ``|relax − TRL|`` weight after the update, in ``worst``.
        weight_step: Largest ``|TRL's after − before|`` in ``worst`` (the scale of ``weight_diff``).
        worst: The tensor with the largest ``weight_diff / weight_step``.
    """

    step: int
    reward: float
    advantage_diff: float
    grad_norm_trl: float
    grad_norm_relax: float
    grad_diff: float
    grad_max: float
    weight_diff: float
    weight_step: float
    worst: str

    @property
    def matches(self) -> bool:
        """Whether relax's weights after are within :data:`MATCH_FRACTION` of TRL's step in every tensor and its
        gradients within :data:`GRAD_MATCH_FRACTION` of TRL's largest."""
        return (
            self.weight_diff <= MATCH_FRACTION * self.weight_step
            and self.grad_diff <= GRAD_MATCH_FRACTION * self.grad_max
        )


def _rows(capture: Capture, tokenizer: Decoder) -> list[tuple[int, SampleRow]]:
    """The captured batch as the Trainer's sample rows, each with its row index in the capture: a group per prompt,
    rewards by relax's decoding, behaviour log-probs still empty."""
    from relax_services.models import OmniPrompt
    from relax_services.services.reward import decode_response

    rows: list[tuple[int, SampleRow]] = []
    prompts: dict[tuple[int, ...], OmniPrompt] = {}
    for i, answer in enumerate(capture["answers"]):
        ids = tuple(capture["prompt_ids"][i][capture["prompt_mask"][i].bool()].tolist())
        response = capture["completion_ids"][i][capture["completion_mask"][i].bool()].tolist()
        if not response:
            raise ValueError(f"captured update {capture['step']}: row {i} has no completion token")
        prompt = prompts.setdefault(ids, OmniPrompt(list(ids)))
        key = "p" + "-".join(map(str, ids))  # one group per distinct prompt (an update's prompts are distinct)
        row: SampleRow = {
            "prompt": prompt,
            "meta": {"task": "text", "answer": answer, "prompt_key": key},
            "response": response,
            "logprobs": [],
            "token_versions": [int(capture["step"])] * len(response),
            "loss_mask": [1] * len(response),
            "reward": exact_match_reward(decode_response(response, tokenizer), answer),
            "reward_error": None,
        }
        rows.append((i, row))
    return rows


def _load_adam(engine: TorchTrainEngine, adam: Mapping[str, Mapping[str, torch.Tensor]]) -> None:
    """Sets the engine's AdamW state from TRL's, matched by parameter name (TRL groups parameters its own way)."""
    if not adam:
        return
    state = engine.optimizer.state_dict()
    names = [n for n, p in engine.model.named_parameters() if p.requires_grad]
    missing = [n for n in names if n not in adam]
    if missing:
        raise ValueError(f"captured Adam state lacks {len(missing)} parameters, e.g. {missing[:3]}")
    state["state"] = {i: {k: v.clone() for k, v in adam[n].items()} for i, n in enumerate(names)}
    engine.optimizer.load_state_dict(state)


def replay_update(capture: Capture, cfg: RunConfig) -> UpdateCheck:
    """relax's update of ``capture``'s batch from ``capture``'s weights and Adam state, against TRL's.

    Args:
        capture: One ``step<NNNN>.pt`` of ``benchmarks/trl_side.py --capture-steps``.
        cfg: The relax side's :class:`~relax_services.config.RunConfig` (``relax_overrides`` of the bench).

    Raises:
        ValueError: A capture whose rows have no completion token or whose Adam state lacks parameters.
    """
    from relax_services.engines.protocols import TrainSample
    from relax_services.engines.torch import build_train_engine
    from relax_services.models.policy import checkpoint_of
    from relax_services.services.trainer import build_train_samples, make_loss_fn, proximal_logprobs

    engine = build_train_engine(cfg)
    engine.model.load_state_dict(capture["before"], strict=True)
    _load_adam(engine, capture["adam"])
    indexed = _rows(capture, checkpoint_of(cfg.model).tokenizer)
    # τ = 0: the behaviour log-probs are the policy's before the update, which these weights are.
    scored = engine.compute_logprobs([TrainSample(r["prompt"], torch.tensor(r["response"])) for _, r in indexed])[0]
    for i, (_, r) in enumerate(indexed):
        r["logprobs"] = scored[i, : len(r["response"])].tolist()
    indexed.sort(key=lambda ir: (ir[1]["meta"]["prompt_key"], ir[0]))  # the Trainer's order: by group, then index
    version = int(capture["step"])
    sample_rows = [r for _, r in indexed]
    samples = build_train_samples(cfg, sample_rows, proximal_logprobs(cfg, engine, sample_rows), version=version)
    ours = torch.tensor([float(s.fields["advantages"][0]) for s in samples])  # [B] one value per row
    theirs = capture["advantages"][[i for i, _ in indexed]].float()  # [B]
    engine.optimizer.zero_grad(set_to_none=True)
    engine.accumulate_gradients(samples, make_loss_fn(cfg))
    params = dict(engine.model.named_parameters())
    trl_grads: Mapping[str, torch.Tensor] = capture["grads"]
    grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in params.items()}
    grad_diff = max(float((grads[n] - g).abs().max()) for n, g in trl_grads.items())
    grad_norm = float(
        torch.nn.utils.clip_grad_norm_(
            [p for p in params.values() if p.grad is not None], cfg.optimizer.grad_clip or float("inf")
        )
    )
    engine.optimizer.step()
    after = engine.model.state_dict()
    ratio = {}
    for name, theirs_after in capture["after"].items():
        diff = float((after[name] - theirs_after).abs().max())
        own = float((theirs_after - capture["before"][name]).abs().max())
        ratio[name] = (diff / own if own > 0 else float("inf") if diff > 0 else 0.0, diff, own)
    worst = max(ratio, key=lambda n: ratio[n][0])
    return UpdateCheck(
        step=version,
        reward=sum(float(r["reward"]) for r in sample_rows) / len(sample_rows),
        advantage_diff=float((ours - theirs).abs().max()),
        grad_norm_trl=float(torch.stack([(g.double() ** 2).sum() for g in trl_grads.values()]).sum().sqrt()),
        grad_norm_relax=grad_norm,
        grad_diff=grad_diff,
        grad_max=max(float(g.abs().max()) for g in trl_grads.values()),
        weight_diff=ratio[worst][1],
        weight_step=ratio[worst][2],
        worst=worst,
    )


def format_checks(checks: Sequence[UpdateCheck]) -> str:
    """The checks as a markdown table, one row per update."""
    lines = [
        "| update | reward | max Δ advantage | grad norm TRL / relax | max Δ grad (max grad) | max Δ weight after "
        "(TRL's step there) | tensor | alike |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in checks:
        lines.append(
            f"| {c.step} | {c.reward:.3f} | {c.advantage_diff:.1e} | {c.grad_norm_trl:.4f} / {c.grad_norm_relax:.4f} "
            f"| {c.grad_diff:.1e} ({c.grad_max:.1e}) | {c.weight_diff:.1e} ({c.weight_step:.1e}) | {c.worst} "
            f"| {'yes' if c.matches else 'NO'} |"
        )
    return "\n".join(lines)

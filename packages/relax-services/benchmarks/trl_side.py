"""TRL's side of ``relax bench trl``: runs TRL's ``GRPOTrainer`` on the benchmark task and writes one JSON line
per update (wall time, mean reward, samples) to ``--out``.

With ``--capture-steps`` it also saves those updates at their boundary (``step<NNNN>.pt`` in ``--capture-dir``):
the training inputs (prompt and completion ids and masks, advantages, each row's answer), the weights and Adam
state before the update, the gradients before clipping, and the weights after; relax replays them
(:mod:`relax_services.bench.trl_replay`). The capture subclasses ``GRPOTrainer`` at two documented hooks
(``_prepare_inputs`` returns the update's batch, ``training_step`` leaves the gradients) and reads the rest
from a callback: nothing in TRL is changed.

Run by the benchmark with the interpreter of its throwaway venv (the only place ``trl`` is installed); it is not
imported by relax. The reward is relax-core's ``exact_match_reward``, the very function relax's reward service
uses, so both sides score alike.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", type=Path, required=True, help="benchmark folder: tokenizer/, task.json")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hparams", type=str, required=True, help="JSON of the shared hyper-parameters")
    parser.add_argument("--capture-steps", type=str, default="", help="comma-separated 0-based updates to save")
    parser.add_argument("--capture-dir", type=Path, default=None, help="where the captured updates go")
    args = parser.parse_args()
    capture = {int(s) for s in args.capture_steps.split(",") if s}
    if capture and args.capture_dir is None:
        parser.error("--capture-steps needs --capture-dir")
    hp: dict[str, Any] = json.loads(args.hparams)

    import torch
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from relax_core import exact_match_reward

    torch.set_num_threads(hp["intra_op_threads"])  # relax's thread count per role

    # The shared policy folder relax trains as model.source: same weights, config and tokenizer.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(args.work / "model"))
    torch.manual_seed(hp["seed"])
    model = Qwen2ForCausalLM.from_pretrained(str(args.work / "model"))
    task = json.loads((args.work / "task.json").read_text(encoding="utf-8"))
    for prompt, ids in task["prompt_ids"].items():  # the ids relax feeds its model, or the sides are not equal
        got = tokenizer(text=[prompt])["input_ids"][0]
        if got != ids:
            raise SystemExit(f"TRL's tokenizer gives {got} for {prompt!r}, relax feeds {ids}")
    pairs_list = list(zip(task["prompts"], task["answers"], strict=True))
    dataset = Dataset.from_list([{"prompt": p, "answer": a} for p, a in pairs_list])

    def reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [exact_match_reward(c, a) for c, a in zip(completions, answer, strict=True)]

    out = args.out.open("w", encoding="utf-8")

    class Timeline(TrainerCallback):
        """One line per optimizer step: when it ended and the batch's mean reward (from the step's log)."""

        def __init__(self) -> None:
            self.pending: dict[str, Any] | None = None

        def on_step_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            self.pending = {"step": int(state.global_step), "time": time.time()}

        def on_log(
            self,
            args: TrainingArguments,
            state: TrainerState,
            control: TrainerControl,
            logs: dict[str, float] | None = None,
            **kwargs: object,
        ) -> None:
            if self.pending is not None and logs and "reward" in logs:
                self.pending["reward"] = float(logs["reward"])
                self.pending["samples"] = hp["groups_per_step"] * hp["group_size"]
                out.write(json.dumps(self.pending) + "\n")
                out.flush()
                self.pending = None

    samples_per_step = hp["groups_per_step"] * hp["group_size"]
    config = GRPOConfig(
        output_dir=str(args.out.parent / "trl_output"),
        use_cpu=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=hp["updates"],
        per_device_train_batch_size=samples_per_step,
        gradient_accumulation_steps=1,
        num_generations=hp["group_size"],
        max_completion_length=hp["max_new_tokens"],
        temperature=hp["temperature"],
        top_p=1.0,
        learning_rate=hp["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=hp["grad_clip"],
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        beta=0.0,
        epsilon=hp["clip_eps"],
        loss_type="grpo",  # per-sequence token mean, then the batch mean (relax's seq-mean-token-mean)
        scale_rewards="group",  # (r - group mean) / group std (relax's norm_adv_by_std)
        num_iterations=1,
        shuffle_dataset=False,  # task.json lists the prompts in the bench's schedule, which relax reads too
        seed=hp["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
        generation_kwargs={"suppress_tokens": hp["suppressed_ids"]},  # relax never samples these ids either
    )
    trainer_class, after_step = (
        _capturing_trainer(GRPOTrainer, capture, args.capture_dir, dict(pairs_list)) if capture else (GRPOTrainer, None)
    )
    trainer = trainer_class(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Timeline(), *([after_step] if after_step is not None else [])],
    )
    trainer.train()
    out.close()


def _capturing_trainer(
    base: type, steps: set[int], folder: Path, answers: dict[str, str]
) -> tuple[type, TrainerCallback]:
    """``base`` (TRL's ``GRPOTrainer``) saving the updates ``steps`` at their boundary into ``folder``, with the
    callback that saves each one once its optimizer step is done."""
    import copy

    import torch
    from transformers import TrainerCallback

    folder.mkdir(parents=True, exist_ok=True)

    def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    class Capturing(base):  # type: ignore[misc]
        pending: dict[str, Any] | None = None

        def _prepare_inputs(self, generation_batch: object) -> dict[str, torch.Tensor]:
            inputs: dict[str, torch.Tensor] = super()._prepare_inputs(generation_batch)
            step = int(self.state.global_step)
            if self.model.training and step in steps:
                optimizer: Any = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate wraps it
                names = {id(p): n for n, p in self.model.named_parameters()}
                adam = {
                    names[id(p)]: copy.deepcopy(optimizer.state[p]) for g in optimizer.param_groups for p in g["params"]
                }
                prompts = [
                    self.processing_class.decode(ids[mask.bool()])
                    for ids, mask in zip(inputs["prompt_ids"], inputs["prompt_mask"], strict=True)
                ]
                Capturing.pending = {
                    "step": step,
                    **{k: inputs[k].detach().clone() for k in ("prompt_ids", "prompt_mask", "completion_ids")},
                    "completion_mask": inputs["completion_mask"].detach().clone(),
                    "advantages": inputs["advantages"].detach().clone(),
                    "answers": [answers[p] for p in prompts],
                    "before": weights(self.model),
                    "adam": {n: st for n, st in adam.items() if st},
                    "optimizer": type(optimizer).__name__,
                    "optimizer_defaults": {
                        k: v for k, v in optimizer.defaults.items() if isinstance(v, int | float | bool | tuple)
                    },
                    "weight_decay": [float(g["weight_decay"]) for g in optimizer.param_groups],
                }
            return inputs

        def training_step(
            self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], num_items_in_batch: object = None
        ) -> torch.Tensor:
            loss: torch.Tensor = super().training_step(model, inputs, num_items_in_batch)
            pending = Capturing.pending
            if pending is not None and "grads" not in pending:  # backward ran; clipping and the step come after
                pending["loss"] = float(loss)
                pending["grads"] = {
                    n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None
                }
            return loss

        @staticmethod
        def after_step_callback() -> TrainerCallback:
            class AfterStep(TrainerCallback):
                def on_step_end(
                    self,
                    args: TrainingArguments,
                    state: TrainerState,
                    control: TrainerControl,
                    model: torch.nn.Module | None = None,
                    **kwargs: object,
                ) -> None:
                    pending = Capturing.pending
                    if pending is not None and model is not None:
                        pending["after"] = weights(model)
                        torch.save(pending, folder / f"step{pending['step']:04d}.pt")
                        Capturing.pending = None

            return AfterStep()

    return Capturing, Capturing.after_step_callback()


if __name__ == "__main__":
    main()

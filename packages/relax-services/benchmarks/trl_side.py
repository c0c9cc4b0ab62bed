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

With ``"task": "config"`` in ``--hparams`` (``relax bench trl --config``, :mod:`relax_services.bench.trl_config`)
it trains ``--model``, a user's checkpoint folder, on ``task.json``'s rows with relax-core's reward runner built from
the run config's reward, then scores its final weights by greedy ``generate`` over the held-out rows.
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
    parser.add_argument("--model", type=Path, default=None, help="--config mode: the checkpoint folder")
    args = parser.parse_args()
    capture = {int(s) for s in args.capture_steps.split(",") if s}
    if capture and args.capture_dir is None:
        parser.error("--capture-steps needs --capture-dir")
    hp: dict[str, Any] = json.loads(args.hparams)
    if hp.get("task") == "config":  # relax bench trl --config: a user's checkpoint, data and reward
        if args.model is None:
            parser.error("the config task needs --model")
        config_main(args.work, args.model, args.out, hp)
        return

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
        # GRPOConfig's default recomputes activations in the backward; relax keeps them, so both sides do.
        gradient_checkpointing=False,
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


def _timeline(out: Any, samples: int, minutes: float | None) -> TrainerCallback:
    """The callback writing one line per optimizer step (when it ended, the batch's mean reward) to ``out``, and
    stopping the training once ``minutes`` have passed since it was made (None: never)."""
    from transformers import TrainerCallback

    start = time.time()

    class Timeline(TrainerCallback):
        def __init__(self) -> None:
            self.pending: dict[str, Any] | None = None

        def on_step_end(
            self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: object
        ) -> None:
            self.pending = {"step": int(state.global_step), "time": time.time()}
            if minutes is not None and time.time() - start >= 60 * minutes:
                control.should_training_stop = True

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
                self.pending["samples"] = samples
                out.write(json.dumps(self.pending) + "\n")
                out.flush()
                self.pending = None

    return Timeline()


def config_main(work: Path, model_dir: Path, out_path: Path, hp: dict[str, Any]) -> None:
    """``relax bench trl --config``: GRPOTrainer on the checkpoint folder ``model_dir`` with the rows of
    ``work/task.json`` (relax's prompts, in relax's order) scored by relax-core's reward runner from the run
    config's reward; at the end, a greedy ``generate`` of the final weights over the held-out rows, scored alike
    (the last line of ``out_path``: ``{"heldout_reward": ..., "time": ...}``)."""
    import statistics

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from relax_core import RewardRequest, RewardRunnerConfig, build_reward_runner

    torch.set_num_threads(hp["intra_op_threads"])  # relax's run.threads
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    torch.manual_seed(hp["seed"])
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    task = json.loads((work / "task.json").read_text(encoding="utf-8"))
    for row in task["train"]:  # the ids relax feeds its model, or the sides are not equal
        got = tokenizer(text=[row["prompt"]], add_special_tokens=False)["input_ids"][0]  # as GRPOTrainer encodes
        if got != row["ids"]:
            raise SystemExit(f"TRL's tokenizer gives {got} for {row['prompt']!r}, relax feeds {row['ids']}")
    runner = build_reward_runner(RewardRunnerConfig.model_validate(hp["reward"]))
    by_prompt = {row["prompt"]: row for row in task["train"]}
    dataset = Dataset.from_list([{"prompt": row["prompt"]} for row in task["train"]])

    def request(response: str, row: dict[str, Any]) -> RewardRequest:
        return RewardRequest(response, row["ground_truth"], row["data_source"], row["extra_info"])

    def reward(prompts: list[str], completions: list[str], **_: object) -> list[float]:
        outcomes = runner.score([request(c, by_prompt[p]) for p, c in zip(prompts, completions, strict=True)])
        return [o.score for o in outcomes]

    per_update = hp["groups_per_step"] * hp["group_size"]
    micro = hp["micro_batch_groups"] * hp["group_size"]  # relax's micro-batch, in samples
    config = GRPOConfig(
        output_dir=str(out_path.parent / "trl_output"),
        use_cpu=True,
        bf16=False,
        # GRPOConfig's default recomputes activations in the backward; here as relax's run config says
        # (trainer.activation_checkpointing, off by default).
        gradient_checkpointing=bool(hp.get("gradient_checkpointing", False)),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        max_steps=hp["updates"],
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=per_update // micro,
        num_generations=hp["group_size"],
        max_completion_length=hp["max_new_tokens"],
        temperature=hp["temperature"],
        top_p=1.0,
        learning_rate=hp["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=hp["weight_decay"],
        max_grad_norm=hp["grad_clip"] or 0.0,  # 0: no clipping, as relax's None
        adam_beta1=hp["betas"][0],
        adam_beta2=hp["betas"][1],
        adam_epsilon=hp["adam_eps"],
        beta=hp["beta"],
        epsilon=hp["clip_eps"],
        epsilon_high=hp["clip_eps_high"],
        loss_type=hp["loss_type"],
        scale_rewards=hp["scale_rewards"],
        num_iterations=1,
        shuffle_dataset=False,  # task.json lists the prompts in relax's order
        seed=hp["seed"],
        dataloader_num_workers=0,
        disable_tqdm=True,
        generation_kwargs={"suppress_tokens": hp["suppressed_ids"]} if hp["suppressed_ids"] else None,
    )
    out = out_path.open("w", encoding="utf-8")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[_timeline(out, per_update, hp["minutes"])],
    )
    trainer.train()
    trained = trainer.model
    trained.eval()
    by_task: dict[str, list[float]] = {}
    with torch.no_grad():
        for row in task["eval"]:
            ids = torch.tensor([row["ids"]])  # [1, P]
            extra = {"suppress_tokens": hp["suppressed_ids"]} if hp["suppressed_ids"] else {}
            full = trained.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=hp["max_new_tokens"], do_sample=False, **extra
            )  # [1, P + L]
            text = tokenizer.decode(full[0, ids.shape[1] :], skip_special_tokens=True)
            score = runner.score([request(text, row)])[0].score
            by_task.setdefault(row["data_source"], []).append(score)
    if by_task:
        mean = statistics.fmean(statistics.fmean(v) for v in by_task.values())  # over tasks, as relax reports
        out.write(json.dumps({"heldout_reward": mean, "time": time.time()}) + "\n")
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

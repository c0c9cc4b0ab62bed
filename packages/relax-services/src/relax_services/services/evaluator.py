"""Evaluator service: greedy decoding of held-out prompts with the newest published weights, reward per task.

It runs in its own process and reads weights from the weight store, so evaluation never stalls training.
"""

from __future__ import annotations

import threading
from collections import defaultdict

from relax_core import build_reward_runner
from relax_services.config import RunConfig
from relax_services.data.prompts import HeldoutReport, HeldoutSet
from relax_services.engines import ReleasesWeights, RolloutEngine
from relax_services.engines.registry import RolloutEngineOptions, make_rollout_engine
from relax_services.engines.sampling import sampling_params
from relax_services.models.policy import checkpoint_of
from relax_services.rows import HeldoutItem, reward_request
from relax_services.services._base import HealthHandle, ServiceBase
from relax_services.services._samples import EvalSample, media_links, prompt_text
from relax_services.services.reward import decode_response
from relax_services.weights import WeightStore

__all__ = ["EvalService"]


class EvalService(ServiceBase):
    """Evaluates every ``eval.every_steps`` versions (and version 0) on a fixed held-out set.

    Args:
        heldout: ``(task, prompt, item)`` triples, never trained on (tasks: the synthetic tasks, or the held-out
            files' data_sources); the item's ground truth and metadata go to the reward. Or the held-out rows
            (:class:`~relax_services.data.prompts.HeldoutSet`), whose prompts are built here, in this process: rows with
            unreadable media are skipped, and :meth:`heldout_report` says which.
    """

    def __init__(
        self,
        name: str,
        cfg: RunConfig,
        heldout: list[HeldoutItem] | HeldoutSet,
        weights: WeightStore,
        *,
        health: HealthHandle | None = None,
    ) -> None:
        super().__init__(name, health)
        self.cfg = cfg
        if isinstance(heldout, HeldoutSet):
            self.heldout, self._report = heldout.build()
        else:
            self.heldout = heldout
            self._report = {"kept": list(range(len(heldout))), "skipped": {}, "bad": []}
        self.weights = weights
        # rollout.engine, finishing each greedy pass on the weights it started with
        self.engine: RolloutEngine = make_rollout_engine(
            cfg, RolloutEngineOptions(partial_rollout="finish_old", role="eval")
        )
        self.runner = build_reward_runner(cfg.reward.runner_config())
        self.params = sampling_params(cfg.model, n=1, max_new_tokens=cfg.rollout.max_new_tokens, temperature=0.0)
        self.tokenizer = checkpoint_of(cfg.model).tokenizer
        self._next_version = 0
        # The periodic loop and evaluate_latest each load, evaluate and release: one at a time (the loop may still be
        # inside an evaluation when evaluate_latest's stop gives up waiting for it).
        self._engine_lock = threading.Lock()
        self.batch = 64
        self.samples: list[EvalSample] = []
        """The last evaluation's conversations: the first ``eval.samples_per_task`` of each task, held-out order."""

    def evaluate(self) -> dict[str, float]:
        """Mean greedy reward per task with the weights currently loaded; keeps the conversations in
        :attr:`samples`."""
        by_task: dict[str, list[float]] = defaultdict(list)
        self.samples = []
        keep = self.cfg.eval.samples_per_task
        for start in range(0, len(self.heldout), self.batch):
            chunk = self.heldout[start : start + self.batch]
            outs = self.engine.generate([p for _, p, _ in chunk], self.params)
            responses = [decode_response(group[0].token_ids, self.tokenizer) for group in outs]
            results = self.runner.score(
                [reward_request(r, info) for r, (_, _, info) in zip(responses, chunk, strict=True)]
            )
            for (task, prompt, info), response, result in zip(chunk, responses, results, strict=True):
                if len(by_task[task]) < keep:
                    text = prompt_text(prompt.input_ids.tolist(), self.tokenizer)
                    media = media_links(info.get("media", []))
                    self.samples.append(EvalSample(task=task, prompt=text, response=response, reward=result.score,
                                                   media=media))  # fmt: skip
                by_task[task].append(result.score)
        return {task: sum(v) / len(v) for task, v in sorted(by_task.items())}

    def step(self) -> None:
        """Evaluate the newest weights when they are ``eval.every_steps`` past the last evaluated version; else wait."""
        latest = self.weights.latest_version()
        newer = None if latest is None or latest < self._next_version else self.weights.fetch(None)
        if newer is None:
            self._stop.wait(0.2)
            return
        with self._engine_lock:
            self.engine.load_weights(newer.state_dict, newer.version)
            rewards = self.evaluate()
            if isinstance(self.engine, ReleasesWeights):  # idle until the next evaluation: pin no version meanwhile
                self.engine.release_weights()
        self.record("eval", version=newer.version, reward=rewards, samples=self.samples)
        self._next_version = newer.version + self.cfg.eval.every_steps

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the loop, then the reward runner's worker threads and remote clients (once the loop is out)."""
        stopped = super().stop(timeout)
        if stopped:
            self.runner.close()
        return stopped

    def heldout_report(self) -> HeldoutReport:
        """Which held-out rows this evaluator kept and which it skipped for unreadable media (see
        :class:`~relax_services.data.prompts.HeldoutReport`)."""
        return self._report

    def evaluate_latest(self) -> tuple[int, dict[str, float], list[EvalSample]]:
        """Stop the periodic loop, load the newest weights and evaluate them (the run's final figure); returns their
        version, the reward per task and the conversations kept (:attr:`samples`)."""
        ServiceBase.stop(self)  # the loop only: the reward runner is needed below (closed by stop())
        newer = self.weights.fetch(None)
        with self._engine_lock:
            if newer is not None:
                self.engine.load_weights(newer.state_dict, newer.version)
            rewards = self.evaluate()
        return self.engine.version, rewards, self.samples

"""``run.threads``: resolved once from the cores and the services that compute, and pinned by every engine."""

from __future__ import annotations

import pytest
import torch

from relax_core.config.base import ConfigError
from relax_services.config import load_run_config
from relax_services.config.threads import UNLAUNCHED_THREADS, compute_services, threads_of, with_threads
from relax_services.engines import SamplingParams, TrainSample
from relax_services.engines.registry import make_rollout_engine, make_train_engine
from relax_services.models import text_prompt


def test_the_cores_are_divided_among_the_services_that_compute() -> None:
    # GRPO with a KL term: Trainer, 3 rollout workers, Evaluator, Reference = 6 services (no Critic).
    cfg = load_run_config(None, ["rollout.replicas=3", "algorithm.kl_coef=0.05"])
    assert cfg.algorithm.uses_reference and not cfg.algorithm.uses_critic
    assert compute_services(cfg) == 1 + 3 + 1 + 1
    assert with_threads(cfg, 16).run.threads == 16 // 6
    assert with_threads(cfg, 2).run.threads == 1  # never 0: fewer cores than services still computes
    given = load_run_config(None, ["run.threads=3"])
    assert with_threads(given, 64).run.threads == 3  # a given count is kept
    assert threads_of(cfg) == UNLAUNCHED_THREADS  # not launched: the fixed count
    with pytest.raises(ConfigError, match=r"run\.threads"):
        load_run_config(None, ["run.threads=0"])


def test_every_engine_computes_with_the_run_count() -> None:
    cfg = load_run_config(None, ["run.threads=2", "algorithm.kl_coef=0.05"])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        trainer = make_train_engine(cfg)
        reference = make_train_engine(cfg, role="reference")
        rollout = make_rollout_engine(cfg)
        sample = TrainSample(prompt=text_prompt([1, 3, 20, 4]), response_ids=torch.tensor([5, 6, 7]))
        for engine in (trainer, reference):
            torch.set_num_threads(1)
            engine.compute_logprobs([sample])
            assert torch.get_num_threads() == 2, type(engine).__name__
        torch.set_num_threads(1)
        rollout.generate([text_prompt([1, 3, 20, 4])], SamplingParams(n=1, max_new_tokens=2))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

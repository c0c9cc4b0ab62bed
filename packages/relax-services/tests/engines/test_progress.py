"""Progress from inside long engine calls: the engines tick per unit of work, and a service counts the ticks of
its step, so a step longer than the heartbeat timeout that keeps working is not taken for a hang."""

from __future__ import annotations

import threading

import torch

from relax_services.engines import HFRolloutEngine, SamplingParams
from relax_services.engines.progress import reporting_progress, tick
from relax_services.engines.scoring import token_scores
from relax_services.models import build_tiny_omni, text_prompt
from relax_services.services._base import ServiceBase


def test_tick_reaches_only_the_thread_that_lent_its_counter() -> None:
    seen: list[str] = []
    tick()  # outside any block: nothing to call
    with reporting_progress(lambda: seen.append("outer")):
        tick()
        with reporting_progress(lambda: seen.append("inner")):
            tick()
        tick()
        other = threading.Thread(target=tick)  # another service's thread: not this counter
        other.start()
        other.join()
    tick()
    assert seen == ["outer", "inner", "outer"]


def test_generation_ticks_per_decode_step_and_scoring_per_lm_head_chunk() -> None:
    ticks = [0]

    def count() -> None:
        ticks[0] += 1

    engine = HFRolloutEngine(build_tiny_omni(0))
    params = SamplingParams(n=2, max_new_tokens=6)  # no end-of-sequence id: every row runs all 6 steps
    with reporting_progress(count):
        groups = engine.generate([text_prompt([1, 3, 20, 4])], params)
    assert all(len(c.token_ids) == 6 for c in groups[0])
    assert ticks[0] == 6

    ticks[0] = 0
    head = torch.nn.Linear(4, 10)
    valid = torch.ones(3, 5, dtype=torch.bool)
    valid[2, 3:] = False  # 13 positions to score
    with reporting_progress(count):
        logp, _ = token_scores(head, torch.randn(3, 5, 4), torch.zeros(3, 5, dtype=torch.long), valid, chunk_tokens=4)
        assert ticks[0] == 4  # ceil(13 / 4) chunks
        logp.sum().backward()
    assert ticks[0] == 8  # and each chunk again when the backward recomputes it


class _LongStep(ServiceBase):
    model_stack = False

    def __init__(self) -> None:
        super().__init__("long", None)
        self.steps = 0

    def step(self) -> None:
        for _ in range(5):  # one step of five units of engine work
            tick()
        self.steps += 1
        if self.steps == 2:
            self._stop.set()


def test_a_service_counts_its_engine_ticks_as_progress() -> None:
    service = _LongStep()
    service._run()
    assert service.steps == 2
    assert service.status()["progress"] == 2 * (5 + 1)  # each step: its 5 ticks and the step itself

"""A second rollout engine is one module plus one registry entry, selected by ``rollout.engine``.

The engine below (uniform sampling over a small vocabulary, no model) lives in this file and is registered into
``ROLLOUT_ENGINES`` as a dotted path; the Rollout service then builds it from the config, seeds it and calls it
only through the :class:`RolloutEngine` protocol.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator, Mapping, Sequence

import pytest
import torch

from relax_queue import QueueConfig, RowInput, TaskSpec, TransferQueue
from relax_services.config import RunConfig, load_run_config
from relax_services.engines import Completion, RolloutEngine, SamplingParams, WeightPoll
from relax_services.engines.registry import (
    ROLLOUT_ENGINES,
    TRAIN_ENGINES,
    RolloutEngineOptions,
    make_rollout_engine,
    make_train_engine,
)
from relax_services.services.rollout import RolloutService, sampling_seed
from relax_services.weights import InProcessWeightStore

VOCAB = 7


class UniformRolloutEngine:
    """Draws every token uniformly from ``VOCAB`` ids with its own RNG; each completion is ``max_new_tokens`` long."""

    def __init__(self) -> None:
        self._version = 0
        self._rng = torch.Generator().manual_seed(0)

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        self._version = version

    def seed(self, seed: int) -> None:
        self._rng.manual_seed(seed)

    def generate(
        self, prompts: Sequence[object], params: SamplingParams, poll_weights: WeightPoll | None = None
    ) -> list[list[Completion]]:
        out = []
        for _ in prompts:
            group = []
            for _ in range(params.n):
                ids = torch.randint(VOCAB, (params.max_new_tokens,), generator=self._rng).tolist()
                n = len(ids)
                group.append(Completion(ids, [-math.log(VOCAB)] * n, [-math.log(VOCAB)] * n, [self._version] * n))
            out.append(group)
        return out


def build_uniform(cfg: RunConfig, options: RolloutEngineOptions) -> UniformRolloutEngine:
    return UniformRolloutEngine()


@pytest.fixture
def uniform(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setitem(ROLLOUT_ENGINES, "uniform", f"{__name__}:build_uniform")
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # a service sets one thread per process


@pytest.mark.usefixtures("uniform")
def test_rollout_service_builds_seeds_and_runs_the_engine_the_config_names() -> None:
    overrides = ["algorithm.group_size=3", "rollout.max_new_tokens=5", "rollout.groups_per_call=2"]
    cfg = load_run_config(
        None, ["rollout.engine=uniform", *overrides, "trainer.groups_per_step=2", "trainer.micro_batch_groups=2"]
    )
    assert isinstance(make_rollout_engine(cfg), UniformRolloutEngine)

    prompts = TransferQueue(QueueConfig(tasks=(TaskSpec("rollout"),)))
    samples = TransferQueue(QueueConfig(tasks=(TaskSpec("trainer"),)))
    service = RolloutService("rollout-0", cfg, prompts, samples, InProcessWeightStore())
    assert isinstance(service.engine, UniformRolloutEngine)
    keys = ["p0", "p1"]
    item = {"task": "toy", "answer": "1"}
    prompts.put_many([RowInput(key, {"item": item, "prompt": f"prompt {key}"}) for key in keys])
    assert samples.admit(6) == 6
    assert cfg.rollout_call_groups == 2
    service.step()  # one batch: both prompts

    rows = {str(r.key): r.fields for r in samples.get("trainer", n=6, timeout=0).rows}
    assert sorted(rows) == ["p0/0", "p0/1", "p0/2", "p1/0", "p1/1", "p1/2"]
    # Independently: a fresh engine seeded with the call's seed draws the same tokens in the same order.
    reference = UniformRolloutEngine()
    reference.seed(sampling_seed(cfg.trainer.seed, keys))
    expected = reference.generate(keys, SamplingParams(n=3, max_new_tokens=5))
    for p, group in zip(keys, expected, strict=True):
        for j, completion in enumerate(group):
            row = rows[f"{p}/{j}"]
            assert row["response"] == completion.token_ids and len(row["response"]) == 5
            assert row["logprobs"] == pytest.approx([-math.log(VOCAB)] * 5)
            assert row["meta"] == {"task": "toy", "answer": "1", "prompt_key": p, "replica": "rollout-0"}


def test_unknown_engine_ids_name_the_field_and_the_known_ids() -> None:
    with pytest.raises(ValueError, match=r"rollout\.engine='nope' is not a registered engine; known: hf"):
        make_rollout_engine(load_run_config(None, ["rollout.engine=nope"]))
    with pytest.raises(ValueError, match=r"trainer\.engine='nope' is not a registered engine; known: fsdp, torch"):
        make_train_engine(load_run_config(None, ["trainer.engine=nope"]))


def test_a_missing_optional_backend_names_its_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the missing-extra path cannot be exercised")
    module = tmp_path / "relax_test_vllm_engine.py"  # type: ignore[operator]
    module.write_text("import vllm\n\n\ndef build(cfg, options):\n    return None\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(ROLLOUT_ENGINES, "vllm", "relax_test_vllm_engine:build")
    with pytest.raises(ImportError, match=r"rollout\.engine='vllm' needs the package 'vllm'.*relax-services\[vllm\]"):
        make_rollout_engine(load_run_config(None, ["rollout.engine=vllm"]))


def test_a_factory_that_builds_no_engine_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TRAIN_ENGINES, "broken", f"{__name__}:build_uniform")  # a rollout engine, not a trainer
    with pytest.raises(TypeError, match=r"trainer\.engine='broken' built UniformRolloutEngine, not a TrainEngine"):
        make_train_engine(load_run_config(None, ["trainer.engine=broken"]))
    assert isinstance(UniformRolloutEngine(), RolloutEngine)


def test_vllm_is_registered_and_without_vllm_resolving_it_names_the_extra() -> None:
    from relax_services.engines.registry import check_engines

    assert ROLLOUT_ENGINES["vllm"] == "relax_services.engines.vllm:build_vllm_rollout_engine"
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here: the missing-extra path cannot be exercised")
    cfg = load_run_config(None, ["rollout.engine=vllm"])
    # The factory's module imports vLLM only when it builds an engine: the registry checks the package itself.
    with pytest.raises(ImportError, match=r"rollout\.engine='vllm' needs the package 'vllm'.*relax-services\[vllm\]"):
        check_engines(cfg)
    with pytest.raises(ImportError, match=r"relax-services\[vllm\]"):
        make_rollout_engine(cfg, RolloutEngineOptions(partial_rollout="finish_old"))


class _NoShutdown:
    """Every `TrainEngine` member but ``shutdown`` (what the Trainer service calls when it stops), delegated."""

    def __init__(self, inner: object) -> None:
        self.inner = inner

    def __getattr__(self, name: str) -> object:
        if name == "shutdown":
            raise AttributeError(name)
        return getattr(self.inner, name)

    version = property(lambda self: self.inner.version)
    step = property(lambda self: self.inner.step)
    compute_logprobs = property(lambda self: self.inner.compute_logprobs)
    compute_scores = property(lambda self: self.inner.compute_scores)
    policy_state = property(lambda self: self.inner.policy_state)
    state_dict = property(lambda self: self.inner.state_dict)
    load_state_dict = property(lambda self: self.inner.load_state_dict)


def build_without_shutdown(cfg: RunConfig, model: object = None) -> _NoShutdown:
    from relax_services.engines.torch import build_train_engine

    return _NoShutdown(build_train_engine(cfg, model))


def test_a_train_engine_without_shutdown_is_refused_by_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(TRAIN_ENGINES, "partial", f"{__name__}:build_without_shutdown")
    with pytest.raises(TypeError, match=r"trainer\.engine='partial' built _NoShutdown, not a TrainEngine"):
        make_train_engine(load_run_config(None, ["trainer.engine=partial"]))
    engine = make_train_engine(load_run_config(None, []))  # the built-in one has it (nothing to release)
    assert engine.shutdown() is None and engine.version == 0

"""Tests of the versioned weight stores (in-process and Ray actor)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from relax_services.engines import HFRolloutConfig, HFRolloutEngine, SamplingParams
from relax_services.models import DEFAULT_SOURCE, build_tiny_omni, open_checkpoint, text_prompt
from relax_services.weights import (
    InProcessWeightStore,
    RayWeightStore,
    WeightPoller,
    WeightStore,
    state_dict_bytes,
)
from relax_services.weights.packed import pack_state, unpack_state

TOKENS = open_checkpoint(DEFAULT_SOURCE).tokens


def _weights(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3, 4), value), "b": torch.arange(5, dtype=torch.int64)}


def _check_store_semantics(store: Any) -> None:
    assert isinstance(store, WeightStore)
    assert store.latest_version() is None and store.fetch(None) is None
    source = _weights(1.0)
    stats = store.publish(1, source)
    assert stats.version == 1 and stats.num_bytes == 12 * 4 + 5 * 8 and stats.seconds >= 0
    source["w"].add_(100.0)  # the trainer keeps training: the published copy must not move
    update = store.fetch(None)
    assert update is not None and update.version == 1 and update.seconds >= 0
    assert torch.equal(update.state_dict["w"], torch.full((3, 4), 1.0))
    assert store.fetch(1) is None  # already have it
    for v in (2, 3, 4):
        store.publish(v, _weights(float(v)))
    assert store.versions() == [3, 4]  # keep=2
    newest = store.fetch(2)
    assert newest is not None and newest.version == 4 and float(newest.state_dict["w"][0, 0]) == 4.0
    with pytest.raises(ValueError, match="not newer"):
        store.publish(4, _weights(0.0))
    # A trainer resumed from the version-3 checkpoint drops the newer version and publishes again.
    assert store.rollback(3) == [4]
    store.publish(4, _weights(-4.0))
    again = store.fetch(3)
    assert again is not None and float(again.state_dict["w"][0, 0]) == -4.0


def test_in_process_store_semantics() -> None:
    _check_store_semantics(InProcessWeightStore(keep=2))
    with pytest.raises(ValueError, match="keep"):
        InProcessWeightStore(keep=0)


def test_state_dict_bytes_counts_tensor_data() -> None:
    assert state_dict_bytes({"a": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)}) == 24 + 8


def test_poller_drives_a_rollout_engine_switch() -> None:
    store = InProcessWeightStore()
    model = build_tiny_omni(0)
    engine = HFRolloutEngine(model, HFRolloutConfig(partial_rollout="switch"))
    poller = WeightPoller(store, lambda: engine.version)
    assert poller() is None
    new = build_tiny_omni(1).state_dict()
    store.publish(7, new)
    groups = engine.generate(
        [text_prompt([1, 3, 20, 4])],
        SamplingParams(n=2, max_new_tokens=4, suppressed_ids=TOKENS.never_sample, eos_id=TOKENS.eos_id),
        poller,
    )
    # Published before the call: picked up at its start.
    assert engine.version == 7 and {v for c in groups[0] for v in c.versions} == {7}
    assert set(poller.sync_seconds) == {7}
    assert torch.equal(engine.model.lm_head.weight, new["lm_head.weight"])
    assert poller() is None


def test_poller_throttles_store_calls() -> None:
    store = InProcessWeightStore()
    calls: list[int | None] = []

    def have() -> int | None:
        calls.append(None)
        return None

    poller = WeightPoller(store, have, min_interval_s=3600.0)
    store.publish(1, _weights(1.0))
    first = poller()
    assert first is not None and first[0] == 1
    store.publish(2, _weights(2.0))
    assert poller() is None and len(calls) == 1  # within the interval: no store call
    poller.min_interval_s = 0.0
    second = poller()
    assert second is not None and second[0] == 2


def test_ray_store_semantics(ray_session: Any) -> None:
    _check_store_semantics(RayWeightStore.create("weights-semantics", keep=2))


def test_ray_store_is_shared_by_name_across_processes(ray_session: Any) -> None:
    ray = ray_session
    store = RayWeightStore.create("weights-shared", keep=3)
    assert RayWeightStore.create("weights-shared").versions() == []  # get-if-exists: same actor

    # The actor's class refers to nothing of this module: a module-level name it used would be pickled by reference,
    # and the actor's process would import this test module, transformers and the default checkpoint with it.
    @ray.remote(num_cpus=0)
    class Trainer:
        def publish(self, version: int, state_dict: dict[str, torch.Tensor]) -> float:
            stats = RayWeightStore.connect("weights-shared").publish(version, state_dict)
            return stats.seconds

        def heavy_modules(self) -> list[str]:
            import sys

            return sorted(m for m in ("transformers", "relax_services.models") if m in sys.modules)

    trainer = Trainer.remote()  # type: ignore[attr-defined]
    for v in (1, 2):
        assert ray.get(trainer.publish.remote(v, _weights(float(v)))) >= 0
    # Publishing needs torch only: no model stack in the trainer's process.
    assert ray.get(trainer.heavy_modules.remote()) == []
    reader = RayWeightStore.connect("weights-shared")  # the driver reads what the trainer process put
    update = reader.fetch(None)
    assert update is not None and update.version == 2 and float(update.state_dict["w"][0, 0]) == 2.0
    assert reader.fetch(2) is None
    local = store.fetch(0)
    assert local is not None and local.version == 2
    assert [h["version"] for h in store.history()] == [1.0, 2.0]
    with pytest.raises(ValueError):
        RayWeightStore.connect("no-such-store")


def test_packed_weights_view_the_tensors_and_keep_ties_and_dtypes() -> None:
    embed = torch.randn(6, 4)
    state = {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: one storage
        "norm.weight": torch.randn(4, dtype=torch.bfloat16),
        "steps": torch.arange(3, dtype=torch.int64),
    }
    packed = pack_state(state)
    assert packed.aliases == {"lm_head.weight": "embed.weight"}
    assert packed.num_bytes == 6 * 4 * 4 + 4 * 2 + 3 * 8  # the tied tensor once
    out = unpack_state(packed)
    assert out.keys() == state.keys()
    for name, tensor in state.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor)
    # No copy on either side: the unpacked tensors view the source's memory, ties stay one tensor.
    assert out["embed.weight"].data_ptr() == embed.data_ptr()
    assert out["lm_head.weight"] is out["embed.weight"]


def test_ray_store_readers_view_one_copy_and_an_engine_computes_with_it(ray_session: Any) -> None:
    """A fetched version is a view of the object store's shared memory (read-only, the same pages for every fetch
    of the node), and a CPU rollout engine in the published dtype computes with those tensors, not a copy."""
    store = RayWeightStore.create("weights-zero-copy", keep=1)
    model = build_tiny_omni(1)
    store.publish(1, model.state_dict())
    first, second = store.fetch(None), store.fetch(None)
    assert first is not None and second is not None
    name = "lm_head.weight"
    assert first.state_dict[name].data_ptr() == second.state_dict[name].data_ptr()  # one copy, not one per fetch
    engine = HFRolloutEngine(build_tiny_omni(0))
    engine.load_weights(first.state_dict, first.version)
    assert engine.model.lm_head.weight.data_ptr() == first.state_dict[name].data_ptr()
    for key, tensor in model.state_dict().items():
        assert torch.equal(engine.model.state_dict()[key], tensor), key
    # Generation on the shared weights equals generation on a private copy of the same weights.
    params = SamplingParams(n=2, max_new_tokens=4, suppressed_ids=TOKENS.never_sample, eos_id=TOKENS.eos_id)
    copied = HFRolloutEngine(build_tiny_omni(1), HFRolloutConfig(seed=3)).generate([text_prompt([1, 3, 20, 4])], params)
    engine.seed(3)
    shared = engine.generate([text_prompt([1, 3, 20, 4])], params)
    assert [c.token_ids for c in shared[0]] == [c.token_ids for c in copied[0]]
    # Another dtype cannot be shared: the engine copies into its own parameters.
    half = HFRolloutEngine(build_tiny_omni(0), HFRolloutConfig(dtype="bfloat16"))
    half.load_weights(first.state_dict, first.version)
    assert half.model.lm_head.weight.dtype == torch.bfloat16
    assert half.model.lm_head.weight.data_ptr() != first.state_dict[name].data_ptr()
    store.publish(2, build_tiny_omni(2).state_dict())
    assert store.versions() == [2]  # keep=1: only the newest stays referenced by the store


def _ptrs(state: dict[str, torch.Tensor]) -> dict[str, int]:
    return {k: t.data_ptr() for k, t in state.items()}


def test_in_process_store_recycles_only_buffers_no_reader_holds() -> None:
    """A reader that computes in place with version 1 (an engine loaded with ``assign``) keeps it bit for bit while
    three more versions are published; a retired version nothing references is written over (same data pointers)
    and then holds the new values."""
    store = InProcessWeightStore(keep=1)
    models = [build_tiny_omni(seed) for seed in range(5)]
    values = [{k: t.clone() for k, t in m.state_dict().items()} for m in models]  # what each version must hold
    store.publish(1, models[1].state_dict())
    first = store.fetch(None)
    assert first is not None
    engine = HFRolloutEngine(build_tiny_omni(0))
    engine.load_weights(first.state_dict, first.version)
    held = _ptrs(engine.model.state_dict())
    assert held == _ptrs(first.state_dict)  # computes with the store's tensors, no copy of its own
    del first
    store.publish(2, models[2].state_dict())  # fresh: the only spare candidate does not exist yet
    second = store.fetch(None)
    assert second is not None
    v2 = _ptrs(second.state_dict)
    del second
    store.publish(3, models[3].state_dict())  # version 1 is the spare, but the engine uses it: fresh again
    assert store.recycled == 0
    store.publish(4, models[4].state_dict())  # version 2, which nobody holds, takes version 4
    assert store.recycled == 1
    fourth = store.fetch(None)
    assert fourth is not None and _ptrs(fourth.state_dict) == v2
    for key, tensor in fourth.state_dict.items():
        assert torch.equal(tensor, values[4][key]), key
    # The reader's version 1 never moved: same memory, same bits.
    assert _ptrs(engine.model.state_dict()) == held
    for key, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, values[1][key]), key
    # A reader that keeps any view of a version (here one row) also keeps it from being reused.
    row = fourth.state_dict["lm_head.weight"][0]
    del fourth
    store.publish(5, models[1].state_dict())  # spare: version 3 (free) -> reused
    store.publish(6, models[2].state_dict())  # spare: version 4, the row still views it -> fresh
    assert store.recycled == 2
    assert torch.equal(row, values[4]["lm_head.weight"][0])


def test_in_process_store_copies_tied_tensors_once_and_can_allocate_every_version() -> None:
    embed = torch.randn(6, 4)
    state = {"embed.weight": embed, "lm_head.weight": embed, "norm.weight": torch.randn(4)}
    for recycle, reused in ((True, 2), (False, 0)):
        store = InProcessWeightStore(keep=1, recycle=recycle)
        for v in range(1, 5):
            stats = store.publish(v, state)
            assert stats.num_bytes == (6 * 4 + 4) * 4  # the tied tensor once
        update = store.fetch(None)
        assert update is not None
        assert update.state_dict["lm_head.weight"] is update.state_dict["embed.weight"]
        assert update.state_dict["embed.weight"].data_ptr() != embed.data_ptr()  # a copy, not the live weights
        assert torch.equal(update.state_dict["lm_head.weight"], embed)
        assert store.recycled == reused  # versions 3 and 4 reuse 1 and 2 (nobody fetched them)

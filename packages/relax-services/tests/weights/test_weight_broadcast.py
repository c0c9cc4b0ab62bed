"""Weight sync by torch.distributed broadcast (gloo on CPU) from a trainer-side sender to rollout workers in
their own processes: the received weights equal the sent ones bit for bit, a bucket smaller than one tensor
works, a restarted worker re-joins at the next version, and a dead one fails that version plainly and is left
out of the next."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from relax_services.weights.broadcast import (
    BroadcastConfig,
    BroadcastWeightReceiver,
    BroadcastWeightSender,
    StateDictSink,
    WeightSyncError,
)
from relax_services.weights.buckets import WeightStream, stream_buckets

WORKER = Path(__file__).with_name("_broadcast_worker.py")
START_S = 180.0  # generous bound on a worker's start on a loaded machine (a hang fails instead of blocking)


def _load_worker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("_broadcast_worker", WORKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


worker = _load_worker()


class Workers:
    """The worker processes of one test; every one is killed at the end."""

    def __init__(self, sender: BroadcastWeightSender, out: Path) -> None:
        self.sender, self.out, self.procs = sender, out, dict[int, subprocess.Popen[bytes]]()

    def start(self, slot: int, until: int, sink: str, env: dict[str, str] | None = None) -> None:
        before = int(self.sender.store.add(f"join/{slot}", 0))
        args = [sys.executable, str(WORKER), self.sender.address, str(slot), "2", str(self.out), str(until), sink]
        environ = {**os.environ, **(env or {})}
        self.procs[slot] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=environ)
        _until(lambda: int(self.sender.store.add(f"join/{slot}", 0)) > before, f"worker {slot} to register")

    def received(self, slot: int, version: int) -> dict[str, torch.Tensor]:
        path = self.out / f"slot{slot}_v{version}.pt"
        _until(path.exists, f"worker {slot} to save version {version}")
        state: dict[str, torch.Tensor] = torch.load(path)
        return state

    def finish(self, slot: int) -> None:
        proc = self.procs.pop(slot)
        _, err = proc.communicate(timeout=START_S)
        assert proc.returncode == 0, err.decode()[-2000:]

    def kill_all(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.communicate()  # reaps it and closes its stderr pipe


def _until(ready: object, what: str) -> None:
    """Polls ``ready()`` until true; fails (does not hang) after START_S. Not a timing assertion: the bound
    only turns a hang into a failure."""
    deadline = time.monotonic() + START_S
    while not ready():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Workers]:
    sender = BroadcastWeightSender("127.0.0.1:0", worker.config(2), host_store=True)
    group = Workers(sender, tmp_path)
    try:
        yield group
    finally:
        (tmp_path / "stop").touch()
        group.kill_all()
        sender.close()


def _step(model: torch.nn.Module, version: int) -> dict[str, torch.Tensor]:
    """A deterministic "update" of every weight; returns a copy of the new weights."""
    gen = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.device, p.dtype))
        model.positions.add_(version)  # type: ignore[operator]
    return {k: v.clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_bad_broadcast_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="receivers"):
        BroadcastConfig(receivers=0)
    with pytest.raises(ValueError, match="backend"):
        BroadcastConfig(backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="join_window_s"):
        BroadcastConfig(join_window_s=0)
    with pytest.raises(ValueError, match="host:port"):
        BroadcastWeightReceiver("localhost", 0)
    sender = BroadcastWeightSender("127.0.0.1:0", BroadcastConfig(receivers=1, backend="gloo"), host_store=True)
    try:
        with pytest.raises(ValueError, match=r"slot 1 is not in 0..0"):
            BroadcastWeightReceiver(sender.address, 1, BroadcastConfig(receivers=1, backend="gloo"))
    finally:
        sender.close()


@pytest.mark.integration
@pytest.mark.slow  # out of the default suite for its 12-minute budget
def test_broadcast_sync_is_exact_rejoins_a_restarted_worker_and_drops_a_dead_one(workers: Workers) -> None:
    sender = workers.sender
    assert isinstance(sender, WeightStream)
    model = worker.Policy(seed=0)
    workers.start(0, until=1000, sink="state")
    workers.start(1, until=2, sink="loader")

    # v1 in buckets of 64 bytes, smaller than every tensor: each travels alone. v2 in one bucket.
    sent = {1: _step(model, 1)}
    stats = sender.send(1, stream_buckets(model, 64))
    assert (stats.num_buckets, sender.members) == (4, (0, 1))
    assert stats.num_bytes == sum(t.numel() * t.element_size() for t in sent[1].values())
    sent[2] = _step(model, 2)
    assert sender.send(2, stream_buckets(model)).num_buckets == 1
    for version in (1, 2):
        assert _equal(workers.received(0, version), sent[version])
        assert _equal(workers.received(1, version), sent[version])  # a BucketLoader into a model
    workers.finish(1)  # it stopped after v2, as a rollout worker that is restarted

    # The restarted worker registers its slot again; the next version re-forms the group with both.
    workers.start(1, until=1000, sink="state")
    sent[3] = _step(model, 3)
    sender.send(3, stream_buckets(model, 256))
    assert sender.members == (0, 1)
    assert _equal(workers.received(0, 3), sent[3]) and _equal(workers.received(1, 3), sent[3])

    # A worker that dies without coming back: the broadcast to it fails, said plainly; the versions after it
    # reach the survivor (once it answers a new generation, which leaves the dead slot out).
    dead = workers.procs.pop(1)
    dead.kill()
    dead.communicate()
    sent[4] = _step(model, 4)
    with pytest.raises(WeightSyncError, match=r"weight sync v4 to workers \[0, 1\] failed"):
        sender.send(4, stream_buckets(model, 256))
    version = 4
    while sender.members != (0,):
        version += 1
        assert version < 10, "the survivor never joined a generation without the dead worker"
        sent[version] = _step(model, version)
        try:
            sender.send(version, stream_buckets(model, 256))
        except WeightSyncError:
            continue
    assert _equal(workers.received(0, version), sent[version])
    assert not (workers.out / "slot1_v4.pt").exists()


@pytest.mark.integration
def test_a_sender_without_workers_drains_its_buckets() -> None:
    sender = BroadcastWeightSender("127.0.0.1:0", BroadcastConfig(receivers=1, backend="gloo"), host_store=True)
    drawn: list[int] = []

    def buckets() -> Iterator[object]:
        for bucket in stream_buckets(worker.Policy(seed=0), 64):
            drawn.append(bucket.index)
            yield bucket

    try:
        stats = sender.send(1, buckets())  # type: ignore[arg-type]
    finally:
        sender.close()
    assert drawn == [0, 1, 2, 3] and stats.num_buckets == 4 and sender.members == ()


def test_a_worker_that_leaves_is_no_longer_waited_for() -> None:
    """A removed replica's slot leaves the registry (the sender's next generation would otherwise wait
    ``join_window_s`` for it at every version), and each leave or join bumps ``joins`` so the sender re-forms."""
    config = BroadcastConfig(receivers=3, backend="gloo")
    sender = BroadcastWeightSender("127.0.0.1:0", config, host_store=True)
    try:
        first, second = (BroadcastWeightReceiver(sender.address, slot, config) for slot in (0, 2))
        assert sender.registered() == [0, 2] and int(sender.store.add("joins", 0)) == 2
        second.leave()
        assert sender.registered() == [0] and int(sender.store.add("joins", 0)) == 3
        assert not second.member
        again = BroadcastWeightReceiver(sender.address, 2, config)  # a replica added later under the same slot
        assert sender.registered() == [0, 2] and again.incarnation == 1 and first.incarnation == 1
    finally:
        sender.close()


def test_a_state_dict_sink_keeps_the_last_whole_version() -> None:
    model = worker.Policy(seed=0)
    sink = StateDictSink()
    buckets = list(stream_buckets(model, 64))
    sink.begin()
    for bucket in buckets:
        sink.apply(bucket)
    sink.finish()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    assert _equal(sink.state_dict, first)
    _step(model, 1)
    sink.begin()
    sink.apply(next(iter(stream_buckets(model, 64))))  # a version broken after its first bucket
    assert _equal(sink.state_dict, first)


@pytest.mark.gpu
def test_nccl_broadcast_sync_is_exact_between_two_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU path: NCCL from the sender on GPU 0 to a worker on GPU 1 (NCCL needs one GPU per rank)."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"NCCL broadcast needs 2 GPUs (one per rank); {torch.cuda.device_count()} visible")
    monkeypatch.setenv("RELAX_SYNC_BACKEND", "nccl")
    torch.cuda.set_device(0)
    sender = BroadcastWeightSender("127.0.0.1:0", worker.config(2), host_store=True)
    group = Workers(sender, tmp_path)
    try:
        group.start(0, until=2, sink="state", env={"CUDA_VISIBLE_DEVICES": "1"})
        model = worker.Policy(seed=0).cuda()
        sent = {1: _step(model, 1)}
        assert sender.send(1, stream_buckets(model, 64)).num_buckets == 4
        sent[2] = _step(model, 2)
        stats = sender.send(2, stream_buckets(model))
        assert sender.members == (0,) and stats.num_buckets == 1
        for version in (1, 2):
            assert _equal(group.received(0, version), {k: v.cpu() for k, v in sent[version].items()})
        group.finish(0)
    finally:
        (tmp_path / "stop").touch()
        group.kill_all()
        sender.close()

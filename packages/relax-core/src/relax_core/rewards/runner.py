"""The reward runner: routes each sample to its reward by ``data_source``, bounds every call by
``timeout_s``, turns any failure into the fallback score, and counts it. It never raises for a reward's
fault.

Sync functions run on daemon worker threads, so a hung one cannot block the process from exiting; Python
cannot stop a thread, so a hung call keeps its thread and the runner starts a replacement (counted in
``stats.hung_threads``, at most ``4 × max_concurrency`` of them).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pydantic

from relax_core.config.base import ConfigModel
from relax_core.rewards.remote import RemoteReward, RemoteRewardConfig
from relax_core.rewards.user import CallStyle, RewardKind, call_style, load_reward_fn, parse_reward_value

__all__ = [
    "RewardOutcome",
    "RewardRequest",
    "RewardRunner",
    "RewardRunnerConfig",
    "RewardSpec",
    "RewardStats",
    "build_reward_runner",
]


class RewardSpec(ConfigModel):
    """One reward: a built-in or user function, or a remote endpoint."""

    fn: str = "exact_match"
    """A registry name (exact_match, multiple_choice, math, math_verify, format, regex, length_penalty,
    weighted), ``module:function``, ``path/to/file.py:function``, or ``remote`` (then ``remote`` is set)."""

    kwargs: dict[str, Any] = pydantic.Field(default_factory=dict)
    """Keyword arguments passed to every call."""

    kind: RewardKind = "auto"
    """scalar / batched / async / async_batched; auto reads it from the function (see ``call_style``)."""

    remote: RemoteRewardConfig | None = None
    """The endpoint, when ``fn`` is ``remote``."""

    @pydantic.model_validator(mode="after")
    def _remote_needs_endpoint(self) -> RewardSpec:
        if (self.fn == "remote") != (self.remote is not None):
            raise ValueError("fn='remote' and a 'remote' endpoint go together (give both or neither)")
        return self


class RewardRunnerConfig(ConfigModel):
    """Which reward scores each sample, and what happens when one fails."""

    default: RewardSpec = pydantic.Field(default_factory=RewardSpec)
    """The reward of samples whose ``data_source`` has no route."""

    routes: dict[str, RewardSpec] = pydantic.Field(default_factory=dict)
    """``data_source`` → its reward (e.g. ``{"openai/gsm8k": {fn: math_verify}}``)."""

    timeout_s: float = pydantic.Field(default=30.0, gt=0.0)
    """Seconds a call may take (one sample, or one batch of a batched function)."""

    fallback_score: float = 0.0
    """Score of a sample whose reward raised, timed out or returned something unusable."""

    max_concurrency: int = pydantic.Field(default=16, ge=1)
    """Per-sample calls in flight at once (and sync worker threads)."""

    base_dir: str | None = None
    """Folder that relative ``file.py:function`` paths start from (default: the working directory)."""


@dataclass(frozen=True)
class RewardRequest:
    """One response to score.

    Attributes:
        response: The response text.
        ground_truth: What the reward compares against.
        data_source: Routes the sample to its reward.
        metadata: Passed to functions that take it (the row's ``extra_info`` and anything else).
    """

    response: str
    ground_truth: Any = None
    data_source: str = ""
    metadata: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardOutcome:
    """The score of one response, or why it is the fallback.

    Attributes:
        score: The reward (the fallback score when ``error`` is set).
        error: What failed (``"TimeoutError: ..."``, ``"KeyError: 'x'"``), None on success.
        details: The other keys of a dict the function returned.
        route: The ``data_source`` route that scored it, or ``"default"``.
    """

    score: float
    error: str | None = None
    details: Mapping[str, Any] = field(default_factory=dict)
    route: str = "default"

    @property
    def ok(self) -> bool:
        """Whether the reward succeeded."""
        return self.error is None


@dataclass
class RewardStats:
    """Counts since the runner was built, overall and per route.

    Attributes:
        scored: Samples scored (failures included).
        errors: Samples whose reward failed (timeouts included).
        timeouts: Samples whose reward ran past ``timeout_s``.
        by_route: Per route: ``{"scored", "errors", "timeouts"}``.
        hung_threads: Worker threads left behind by sync calls that timed out.
        last_error: The most recent error message.
    """

    scored: int = 0
    errors: int = 0
    timeouts: int = 0
    by_route: dict[str, dict[str, int]] = field(default_factory=dict)
    hung_threads: int = 0
    last_error: str | None = None


@dataclass(frozen=True)
class _Bound:
    name: str
    fn: Callable[..., Any]
    style: CallStyle
    kwargs: Mapping[str, Any]


class _DaemonWorkers:
    """A small pool of daemon threads (a stuck task must not keep the interpreter from exiting)."""

    def __init__(self, size: int) -> None:
        self._tasks: queue.SimpleQueue[tuple[Future[Any], Callable[[], Any]] | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._size = size
        self.max_threads = 5 * size

    def submit(self, call: Callable[[], Any]) -> Future[Any]:
        if len(self._threads) < self._size:
            self._spawn()
        future: Future[Any] = Future()
        self._tasks.put((future, call))
        return future

    def replace_stuck(self) -> bool:
        """Start a thread in place of one stuck in a call; False when the cap is reached."""
        if len(self._threads) >= self.max_threads:
            return False
        self._spawn()
        return True

    def _spawn(self) -> None:
        thread = threading.Thread(target=self._work, name="reward-worker", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            future, call = task
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(call())
                except BaseException as exc:  # the caller sees every failure, KeyboardInterrupt included
                    future.set_exception(exc)

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put(None)


class _SequentialRun:
    """Calls ``call(0), call(1), ...`` on one worker thread, recording each result or exception, and lets the
    waiting side see which call is running since when, and abandon the run (the thread stops after the call
    it is stuck in, if that ever returns)."""

    def __init__(self, n: int, call: Callable[[int], tuple[float, dict[str, Any]]]) -> None:
        self.results: list[tuple[float, dict[str, Any]] | BaseException | None] = [None] * n
        self.started = False
        self._call = call
        self._current = 0
        self._since = time.monotonic()  # queued time counts against the first call (all workers stuck)
        self._abandoned = False
        self._lock = threading.Lock()

    def position(self) -> tuple[int, float]:
        """Index of the running call and when it started (monotonic seconds)."""
        with self._lock:
            return self._current, self._since

    def abandon_if_at(self, index: int, since: float) -> bool:
        """Abandon the run if it is still in call ``index`` begun at ``since``; whether it did."""
        with self._lock:
            if (self._current, self._since) != (index, since) or self.results[index] is not None:
                return False
            self._abandoned = True
            return True

    def work(self) -> None:
        with self._lock:
            self.started = True
            self._since = time.monotonic()
        for i in range(len(self.results)):
            with self._lock:
                if self._abandoned:
                    return
                self._current, self._since = i, time.monotonic()
            result: tuple[float, dict[str, Any]] | BaseException
            try:
                result = self._call(i)
            except BaseException as exc:  # even SystemExit from a reward is that sample's failure, not the run's
                result = exc
            with self._lock:
                if self._abandoned:
                    return
                self.results[i] = result


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


class RewardRunner:
    """Scores batches of :class:`RewardRequest`; built by :func:`build_reward_runner`.

    Args:
        default: The reward of unrouted samples: a callable, or ``(callable, kind, kwargs)``.
        routes: ``data_source`` → reward, in the same forms.
        timeout_s: Bound of each call.
        fallback_score: Score of failed samples.
        max_concurrency: Per-sample calls in flight.
    """

    def __init__(
        self,
        default: Callable[..., Any] | tuple[Callable[..., Any], RewardKind, Mapping[str, Any]],
        routes: Mapping[str, Callable[..., Any] | tuple[Callable[..., Any], RewardKind, Mapping[str, Any]]]
        | None = None,
        *,
        timeout_s: float = 30.0,
        fallback_score: float = 0.0,
        max_concurrency: int = 16,
    ) -> None:
        self._default = self._bind("default", default)
        self._routes = {name: self._bind(name, r) for name, r in (routes or {}).items()}
        self.timeout_s = timeout_s
        self.fallback_score = fallback_score
        self.max_concurrency = max_concurrency
        self.stats = RewardStats()
        self._workers = _DaemonWorkers(max_concurrency)
        self._owned: list[RemoteReward] = []

    @staticmethod
    def _bind(
        name: str, reward: Callable[..., Any] | tuple[Callable[..., Any], RewardKind, Mapping[str, Any]]
    ) -> _Bound:
        fn, kind, kwargs = reward if isinstance(reward, tuple) else (reward, "auto", {})
        return _Bound(name, fn, call_style(fn, kind), dict(kwargs))

    def score(self, requests: Sequence[RewardRequest]) -> list[RewardOutcome]:
        """Score a batch from synchronous code (async rewards run on a fresh event loop).

        Raises:
            RuntimeError: Called from inside a running event loop; use :meth:`ascore` there.
        """
        return asyncio.run(self.ascore(requests))

    async def ascore(self, requests: Sequence[RewardRequest]) -> list[RewardOutcome]:
        """Score a batch; per-sample rewards run concurrently (``max_concurrency``), each under ``timeout_s``."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(request.data_source if request.data_source in self._routes else "", []).append(i)
        limit = asyncio.Semaphore(self.max_concurrency)
        out: list[RewardOutcome | None] = [None] * len(requests)

        async def run_group(route: str, indices: list[int]) -> None:
            bound = self._routes[route] if route else self._default
            chunk = [requests[i] for i in indices]
            if bound.style.batched:
                outcomes = await self._batched(bound, chunk, limit)
            elif not bound.style.is_async:
                # Sync per-sample calls go to the workers in a few sequential runs, not one hop per sample
                # (a hop plus an asyncio wait costs far more than a typical rule-based reward).
                parts = min(self.max_concurrency, len(chunk))
                runs = [chunk[k::parts] for k in range(parts)]
                done = await asyncio.gather(*(self._sync_run(bound, run) for run in runs))
                outcomes = [RewardOutcome(0.0)] * len(chunk)
                for k, run_outcomes in enumerate(done):
                    outcomes[k::parts] = run_outcomes
            else:
                outcomes = list(await asyncio.gather(*(self._one(bound, r, limit) for r in chunk)))
            for i, outcome in zip(indices, outcomes, strict=True):
                out[i] = outcome

        await asyncio.gather(*(run_group(route, indices) for route, indices in groups.items()))
        results = [o for o in out if o is not None]
        self._count(results)
        return results

    @staticmethod
    def _arguments(bound: _Bound, chunk: Sequence[RewardRequest]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        metas = [{"data_source": r.data_source, **r.metadata} for r in chunk]
        args, kwargs = bound.style.args(
            [r.response for r in chunk], [r.ground_truth for r in chunk], [r.data_source for r in chunk], metas
        )
        kwargs.update(bound.kwargs)
        return args, kwargs

    @classmethod
    def _invoke(cls, bound: _Bound, request: RewardRequest) -> tuple[float, dict[str, Any]]:
        """One sync per-sample call (on a worker thread)."""
        args, kwargs = cls._arguments(bound, [request])
        return parse_reward_value(bound.fn(*args, **kwargs))

    async def _sync_run(self, bound: _Bound, requests: Sequence[RewardRequest]) -> list[RewardOutcome]:
        """Score ``requests`` one after another on one worker, each call bounded by ``timeout_s`` from its start.

        A call past its deadline is abandoned (its thread replaced) and the rest go to a new run.
        """
        if not requests:
            return []
        run = _SequentialRun(len(requests), lambda i: self._invoke(bound, requests[i]))
        finished = asyncio.wrap_future(self._workers.submit(run.work))
        while True:
            current, started = run.position()
            try:
                await asyncio.wait_for(asyncio.shield(finished), max(0.0, started + self.timeout_s - time.monotonic()))
                break
            except TimeoutError:
                if not run.abandon_if_at(current, started):
                    continue  # the run moved on since we looked: wait for the next call's deadline
            if run.started and self._workers.replace_stuck():
                self.stats.hung_threads += 1
            head = [self._outcome(bound, r) for r in run.results[:current]]
            rest = await self._sync_run(bound, requests[current + 1 :])
            return [*head, self._failed(bound, TimeoutError()), *rest]
        return [self._outcome(bound, r) for r in run.results]

    def _outcome(self, bound: _Bound, result: tuple[float, dict[str, Any]] | BaseException | None) -> RewardOutcome:
        if isinstance(result, BaseException):
            return self._failed(bound, result)
        assert result is not None  # every call before the current one has finished
        return RewardOutcome(result[0], None, result[1], bound.name)

    async def _call(self, bound: _Bound, chunk: Sequence[RewardRequest]) -> list[tuple[float, dict[str, Any]]]:
        args, kwargs = self._arguments(bound, chunk)
        if bound.style.is_async:
            value = await asyncio.wait_for(bound.fn(*args, **kwargs), self.timeout_s)
        else:
            future = self._workers.submit(lambda: bound.fn(*args, **kwargs))
            try:
                value = await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
            except TimeoutError:
                if future.running() and self._workers.replace_stuck():
                    self.stats.hung_threads += 1
                raise
        values = list(value) if bound.style.batched else [value]
        if len(values) != len(chunk):
            raise ValueError(f"batched reward returned {len(values)} values for {len(chunk)} responses")
        return [parse_reward_value(v) for v in values]

    def _failed(self, bound: _Bound, exc: BaseException) -> RewardOutcome:
        if isinstance(exc, TimeoutError):
            return RewardOutcome(
                self.fallback_score, f"TimeoutError: no reward within {self.timeout_s} s", route=bound.name
            )
        return RewardOutcome(self.fallback_score, _describe(exc), route=bound.name)

    async def _one(self, bound: _Bound, request: RewardRequest, limit: asyncio.Semaphore) -> RewardOutcome:
        async with limit:
            try:
                ((score, details),) = await self._call(bound, [request])
            except Exception as exc:  # a reward's failure is the sample's, never the run's
                return self._failed(bound, exc)
        return RewardOutcome(score, None, details, bound.name)

    async def _batched(
        self, bound: _Bound, chunk: Sequence[RewardRequest], limit: asyncio.Semaphore
    ) -> list[RewardOutcome]:
        try:
            values = await self._call(bound, chunk)
        except TimeoutError as exc:
            return [self._failed(bound, exc) for _ in chunk]  # one at a time could take len × timeout
        except Exception:
            # Isolate the failing sample(s): rescore one at a time.
            return list(await asyncio.gather(*(self._one(bound, r, limit) for r in chunk)))
        return [RewardOutcome(score, None, details, bound.name) for score, details in values]

    def _count(self, outcomes: Sequence[RewardOutcome]) -> None:
        for o in outcomes:
            route = self.stats.by_route.setdefault(o.route, {"scored": 0, "errors": 0, "timeouts": 0})
            timed_out = o.error is not None and o.error.startswith("TimeoutError")
            self.stats.scored += 1
            route["scored"] += 1
            if o.error is not None:
                self.stats.errors += 1
                route["errors"] += 1
                self.stats.last_error = o.error
            if timed_out:
                self.stats.timeouts += 1
                route["timeouts"] += 1

    def close(self) -> None:
        """Stop the worker threads and remote clients this runner built."""
        self._workers.close()
        for remote in self._owned:
            remote.close()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _resolve(
    spec: RewardSpec, base_dir: str | None, owned: list[RemoteReward]
) -> tuple[Callable[..., Any], RewardKind, Mapping[str, Any]]:
    if spec.remote is not None:
        remote = RemoteReward(spec.remote)
        owned.append(remote)
        return remote, "async", spec.kwargs
    return load_reward_fn(spec.fn, base_dir=Path(base_dir) if base_dir else None), spec.kind, spec.kwargs


def build_reward_runner(cfg: RewardRunnerConfig) -> RewardRunner:
    """Load every reward of the config and build the runner (close it when done).

    Raises:
        ValueError: A reward cannot be loaded, or its declared kind contradicts it (naming the route).
    """
    owned: list[RemoteReward] = []
    try:
        default = _resolve(cfg.default, cfg.base_dir, owned)
        routes = {}
        for source, spec in cfg.routes.items():
            try:
                routes[source] = _resolve(spec, cfg.base_dir, owned)
            except ValueError as exc:
                raise ValueError(f"reward route {source!r}: {exc}") from exc
        runner = RewardRunner(
            default,
            routes,
            timeout_s=cfg.timeout_s,
            fallback_score=cfg.fallback_score,
            max_concurrency=cfg.max_concurrency,
        )
    except BaseException:
        for remote in owned:
            remote.close()
        raise
    runner._owned = owned
    return runner

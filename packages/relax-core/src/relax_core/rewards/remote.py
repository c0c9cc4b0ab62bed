"""A reward served over HTTP (a sandbox, a judge, a reward model): JSON in, JSON out.

Protocol: ``POST <url>`` with ``{"response", "ground_truth", "data_source", "metadata"}``; the reply is a
JSON number or an object with a numeric ``"score"`` (other keys become details). Requests run on the
stdlib HTTP client in a pool of ``max_concurrency`` threads, which is the concurrency limit; connection
failures, timeouts, 429 and 5xx replies are retried with exponential backoff, other 4xx are not.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pydantic

from relax_core.config.base import ConfigModel

__all__ = ["RemoteReward", "RemoteRewardConfig", "RemoteRewardError"]


class RemoteRewardConfig(ConfigModel):
    """Where a remote reward lives and how hard to try."""

    url: str
    """Endpoint that takes the POST (``http://host:port/path``)."""

    request_timeout_s: float = pydantic.Field(default=30.0, gt=0.0)
    """Seconds one HTTP request may take (connect + reply)."""

    max_concurrency: int = pydantic.Field(default=8, ge=1)
    """Requests in flight at once."""

    retries: int = pydantic.Field(default=3, ge=0)
    """Extra attempts after a failed one (connection error, timeout, 429 or 5xx)."""

    backoff_s: float = pydantic.Field(default=0.5, ge=0.0)
    """Wait before the first retry; doubled before each further one."""

    headers: dict[str, str] = pydantic.Field(default_factory=dict)
    """Extra request headers (an ``Authorization`` token, ...)."""


class RemoteRewardError(RuntimeError):
    """The endpoint failed for good: a non-retryable reply, or every attempt failed."""


class RemoteReward:
    """An async per-sample reward function ``await reward(response, ground_truth, metadata)`` over HTTP.

    Call :meth:`close` (or use it as a context manager) to stop its threads.
    """

    def __init__(self, cfg: RemoteRewardConfig) -> None:
        self.cfg = cfg
        self._pool = ThreadPoolExecutor(cfg.max_concurrency, thread_name_prefix="remote-reward")
        self._lock = threading.Lock()
        self.attempts = 0
        """HTTP requests sent, retries included."""

    async def __call__(self, response: str, ground_truth: Any, metadata: Mapping[str, Any]) -> Any:
        payload = {
            "response": response,
            "ground_truth": ground_truth,
            "data_source": metadata.get("data_source", ""),
            "metadata": dict(metadata),
        }
        body = json.dumps(payload, default=str).encode()
        return await asyncio.wrap_future(self._pool.submit(self._post, body))

    def _post(self, body: bytes) -> Any:
        delay = self.cfg.backoff_s
        failure = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                time.sleep(delay)
                delay *= 2
            with self._lock:
                self.attempts += 1
            request = urllib.request.Request(
                self.cfg.url, body, {"Content-Type": "application/json", **self.cfg.headers}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.cfg.request_timeout_s) as reply:
                    return json.loads(reply.read())
            except urllib.error.HTTPError as exc:
                exc.close()  # it holds the reply's socket
                failure = f"HTTP {exc.code} {exc.reason}"
                if exc.code != 429 and exc.code < 500:
                    raise RemoteRewardError(f"{self.cfg.url}: {failure} (not retried)") from exc
            except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
                failure = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
            except json.JSONDecodeError as exc:
                raise RemoteRewardError(f"{self.cfg.url}: reply is not JSON: {exc}") from exc
        raise RemoteRewardError(f"{self.cfg.url}: {self.cfg.retries + 1} attempts failed, last: {failure}")

    def close(self) -> None:
        """Stop the request threads (requests in flight finish first)."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> RemoteReward:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

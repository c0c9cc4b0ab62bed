"""User reward functions: loading by name, ``module:function`` or ``path/to/file.py:function``, and calling
them in whichever convention their signature declares.

Conventions (the first parameter names decide; see :func:`call_style`):

- per-sample: ``fn(response, ground_truth, metadata, **kwargs)``; the ``metadata`` parameter may be left
  out (``fn(response, ground_truth, **kwargs)``, the built-ins' form).
- batched: ``fn(responses, ground_truths, metadatas, **kwargs) -> list`` (declare ``kind="batched"``).
- verl's: ``compute_score(data_source, solution_str, ground_truth, extra_info=None)`` and its batched
  ``(data_sources, solution_strs, ground_truths, extra_infos)``, called with keywords.
- any of them ``async def`` (a coroutine, or a callable object whose ``__call__`` is one).

Each returns a float, or a dict with a ``"score"`` float and any other details.
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import math
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from relax_core.rewards.registry import resolve_reward_fn

__all__ = ["CallStyle", "RewardKind", "call_style", "import_file", "load_reward_fn", "parse_reward_value"]

RewardKind = Literal["auto", "scalar", "batched", "async", "async_batched"]


def import_file(path: Path, prefix: str, label: str) -> types.ModuleType:
    """The Python file ``path`` imported as a module of its own (once per process), for a user's code that is a
    file rather than a package: its name is ``prefix`` and a hash of the path, so two files both called
    ``reward.py`` (or ``env.py``) coexist, and the module stays in ``sys.modules`` so pickles find it again.

    Args:
        path: The file (absolute).
        prefix: The module name's prefix (which kind of user code it is).
        label: What the errors name first (the config field and its value).

    Raises:
        ValueError: The file cannot be loaded as a module, or importing it raised (the message names ``label``,
            the file and the error; the failed module is not kept).
    """
    name = f"{prefix}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if (module := sys.modules.get(name)) is not None:
        return module
    loader_spec = importlib.util.spec_from_file_location(name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ValueError(f"{label}: cannot load {str(path)!r} as a Python module")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(f"{label}: importing {str(path)!r} failed: {type(exc).__name__}: {exc}") from exc
    return module


def load_reward_fn(spec: str, *, base_dir: str | Path | None = None) -> Callable[..., Any]:
    """A registry name, ``pkg.mod:fn`` / ``pkg.mod.fn``, or ``path/to/file.py:fn`` to the callable.

    Args:
        spec: What to load. A spec whose part before the last ``:`` ends in ``.py`` is a file.
        base_dir: Folder a relative file path starts from (default: the working directory).

    Raises:
        ValueError: The file does not exist, fails to import, or has no such callable; or the name is
            neither registered nor importable (the message says which).
    """
    file_part, sep, attr = spec.rpartition(":")
    if not (sep and file_part.endswith(".py")):
        return resolve_reward_fn(spec)
    path = Path(file_part)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    path = path.resolve()
    if not path.is_file():
        raise ValueError(f"reward {spec!r}: file {str(path)!r} does not exist")
    # Pickling a function defined there must find its module again in this process: import_file keeps it.
    module = import_file(path, "relax_user_reward", f"reward {spec!r}")
    fn = getattr(module, attr, None)
    if fn is None or not callable(fn):
        raise ValueError(f"reward {spec!r}: {str(path)!r} has no callable {attr!r}")
    result: Callable[..., Any] = fn
    return result


@dataclass(frozen=True)
class CallStyle:
    """How to call one reward function.

    Attributes:
        batched: Takes lists and returns one value per element.
        is_async: Returns an awaitable.
        metadata: Takes the sample metadata as its third positional argument.
        verl: verl's keyword convention (``data_source``, ``solution_str``, ``ground_truth``, ``extra_info``).
    """

    batched: bool
    is_async: bool
    metadata: bool
    verl: bool

    def args(
        self,
        responses: Sequence[str],
        truths: Sequence[Any],
        sources: Sequence[str],
        metas: Sequence[Mapping[str, Any]],
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Positional and keyword arguments of one call (lists of length 1 for a per-sample function)."""
        if self.verl:
            if self.batched:
                names = ("data_sources", "solution_strs", "ground_truths", "extra_infos")
                return (), dict(zip(names, (sources, responses, truths, metas), strict=True))
            return (), {
                "data_source": sources[0],
                "solution_str": responses[0],
                "ground_truth": truths[0],
                "extra_info": metas[0],
            }
        if self.batched:
            return ((responses, truths, metas) if self.metadata else (responses, truths)), {}
        return ((responses[0], truths[0], metas[0]) if self.metadata else (responses[0], truths[0])), {}


def _is_coroutine_fn(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def call_style(fn: Callable[..., Any], kind: RewardKind = "auto") -> CallStyle:
    """Read the calling convention from ``fn``'s signature and the declared ``kind``.

    ``auto`` is async for coroutine functions, batched for verl's plural names, per-sample otherwise; a
    batched function of our convention must be declared (``batched`` / ``async_batched``), as its
    signature alone looks like a per-sample one.

    Raises:
        ValueError: ``kind`` contradicts the function (async declared for a plain function or vice versa).
    """
    params = list(inspect.signature(fn).parameters.values())
    names = {p.name for p in params}
    verl = bool(names & {"solution_str", "solution_strs"})
    is_async = _is_coroutine_fn(fn)
    if kind == "auto":
        batched = "solution_strs" in names
    else:
        batched = kind in ("batched", "async_batched")
        if kind.startswith("async") != is_async:
            nature = "a coroutine function" if is_async else "not a coroutine function"
            raise ValueError(f"reward declared kind={kind!r} but {getattr(fn, '__name__', fn)!r} is {nature}")
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    takes_meta = len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params) or "metadata" in names
    return CallStyle(batched=batched, is_async=is_async, metadata=takes_meta and not verl, verl=verl)


def parse_reward_value(value: Any) -> tuple[float, dict[str, Any]]:
    """A function's return value to ``(score, details)``: a number, or a dict with a numeric ``"score"``.

    Raises:
        TypeError: Neither a number nor such a dict.
        ValueError: The score is not finite.
    """
    details: dict[str, Any] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise TypeError(f"reward returned a dict without 'score' (keys: {sorted(value)})")
        details = {k: v for k, v in value.items() if k != "score"}
        value = value["score"]
    if not isinstance(value, int | float):  # bool is an int: True/False score 1/0
        raise TypeError(f"reward returned {type(value).__name__}, expected a float or a dict with 'score'")
    if not math.isfinite(value):
        raise ValueError(f"reward returned a non-finite score {value}")
    return float(value), details

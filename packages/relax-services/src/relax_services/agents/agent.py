"""The black-box agent a user brings (``rollout.agent``): ``async def run(task, client)`` loaded from
``path/file.py:fn`` or ``module:fn``.

``task`` is the prompt row's item (what an environment's ``reset`` receives); ``client`` is an
``openai.AsyncOpenAI`` pointed at the chat-completions endpoint the Rollout serves for this episode. The function
returns the episode's reward (a number), or None for the run's ``reward.fn`` to score the final conversation. Every
problem with the function is an :class:`AgentSpecError` when it is loaded, naming the file or module.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import cast

from relax_services.agents.environment import EnvironmentSpecError, load_module_of

__all__ = ["AgentFn", "AgentSpec", "AgentSpecError", "load_agent"]

AgentFn = Callable[[object, object], Coroutine[object, object, object]]
"""``async def run(task, client) -> float | None``."""


class AgentSpecError(EnvironmentSpecError):
    """An agent spec that cannot be used: the module does not import, it has no such function, or the function is
    not ``async def`` with the two parameters ``(task, client)``. The message names the file or module."""


@dataclass(frozen=True)
class AgentSpec:
    """A loaded agent function.

    Attributes:
        spec: The ``rollout.agent`` string it was loaded from.
        fn: The coroutine function, called once per episode.
        where: The file or module it came from (in messages).
    """

    spec: str
    fn: AgentFn
    where: str

    @property
    def name(self) -> str:
        """The function's name (in messages)."""
        return str(getattr(self.fn, "__qualname__", self.spec))


def _load_function(spec: str) -> tuple[object, str]:
    module, where, attr = load_module_of(spec, "rollout.agent", "function", "relax_user_agent", AgentSpecError)
    if not hasattr(module, attr):
        raise AgentSpecError(f"rollout.agent {spec!r}: {where!r} has no function {attr!r}")
    return getattr(module, attr), where


def load_agent(spec: str) -> AgentSpec:
    """Loads ``rollout.agent`` and checks its signature.

    Args:
        spec: ``path/to/file.py:function`` (relative to the working directory) or ``module:function``.

    Raises:
        AgentSpecError: naming the file or module: it does not import, lacks the function, or the function is not
            ``async def fn(task, client)``.
    """
    fn, where = _load_function(spec)
    at = f"rollout.agent: {where}: {getattr(fn, '__qualname__', spec.rpartition(':')[2])}"
    if not inspect.iscoroutinefunction(fn):
        kind = "a function" if callable(fn) else type(fn).__name__
        raise AgentSpecError(f"{at} must be 'async def run(task, client)', got {kind} that is not async")
    params = list(inspect.signature(fn).parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required_rest = [p.name for p in params[2:] if p.default is p.empty and p.kind not in variadic]
    if len(positional) < 2 or required_rest:
        names = ", ".join(p.name for p in params)
        raise AgentSpecError(
            f"{at}({names}) must take exactly the two arguments (task, client) (further ones need defaults)"
        )
    return AgentSpec(spec, cast(AgentFn, fn), where)

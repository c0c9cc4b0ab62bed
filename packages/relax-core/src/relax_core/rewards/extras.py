r"""More built-in rewards: a math-verify answer check, regex, length penalty and a weighted combination.

Each is a scalar reward ``(response, ground_truth, **kwargs) -> float`` like those of ``rewards/basic.py``.

``math_verify`` first tries the exact numeric comparison of :func:`math_reward` (fast, no SymPy) and, when
that does not match, asks Hugging Face's ``math-verify`` (LaTeX → SymPy, symbolic equality: ``(x+1)^2`` =
``x^2+2x+1``, ``\frac{1}{\sqrt 2}`` = ``\frac{\sqrt 2}{2}``). math-verify's own timeouts use SIGALRM, which
works only on the main thread, so they are switched off here; the reward runner's ``timeout_s`` bounds it.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from relax_core.rewards.basic import extract_boxed, math_reward

__all__ = [
    "length_penalty_reward",
    "math_verify_reward",
    "regex_reward",
    "weighted_reward",
]


class _NoTimeoutNotice(logging.Filter):
    """Drop math-verify's per-call notice that its own timeout is off (we bound calls ourselves)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


@lru_cache(maxsize=1)
def _math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    # Imported on first use: SymPy and the LaTeX grammar take seconds to import.
    from math_verify import parse, verify

    for name in ("math_verify.parser", "math_verify.grader", "math_verify.utils", "math_verify"):
        logging.getLogger(name).addFilter(_NoTimeoutNotice())
    return parse, verify


def math_verify_reward(response: str, ground_truth: Any) -> float:
    r"""1.0 if the response's final answer equals the ground truth numerically or symbolically.

    The answer is read as :func:`math_reward` reads it (last ``\boxed{}``, "answer is", last number) and
    compared exactly first; otherwise math-verify parses the boxed answer (or the whole response) and the
    ground truth (as LaTeX) and checks equivalence.
    """
    if math_reward(response, ground_truth) == 1.0:
        return 1.0
    parse, verify = _math_verify()
    truth = str(ground_truth).strip()
    gold = parse(truth if "$" in truth or "\\boxed" in truth else f"${truth}$", parsing_timeout=None)
    boxed = extract_boxed(response)
    answer = parse(f"$\\boxed{{{boxed}}}$" if boxed is not None else response, parsing_timeout=None)
    if not gold or not answer:
        return 0.0
    return float(bool(verify(gold, answer, timeout_seconds=None)))


def regex_reward(
    response: str, ground_truth: Any = None, *, pattern: str | None = None, mode: str = "search", flags: str = "s"
) -> float:
    """1.0 if ``pattern`` matches the response.

    Args:
        response: The response text.
        ground_truth: Used as the pattern when ``pattern`` is None (a per-row regex).
        pattern: The regular expression.
        mode: ``search`` (anywhere), ``match`` (at the start) or ``fullmatch`` (the whole response).
        flags: Letters of :mod:`re` flags: ``i`` ignore case, ``m`` multiline, ``s`` dot matches newline.

    Raises:
        ValueError: An unknown mode or flag, or no pattern at all.
    """
    regex = pattern if pattern is not None else ground_truth
    if not isinstance(regex, str):
        raise ValueError("regex_reward needs a pattern (kwarg) or a string ground truth")
    table = {"i": re.IGNORECASE, "m": re.MULTILINE, "s": re.DOTALL}
    bits = 0
    for letter in flags:
        if letter not in table:
            raise ValueError(f"regex_reward: unknown flag {letter!r}; allowed: i, m, s")
        bits |= table[letter]
    matchers = {"search": re.search, "match": re.match, "fullmatch": re.fullmatch}
    if mode not in matchers:
        raise ValueError(f"regex_reward: mode {mode!r} is not one of search, match, fullmatch")
    return float(matchers[mode](regex, response, bits) is not None)


def length_penalty_reward(
    response: str, ground_truth: Any = None, *, target: int = 0, max_length: int = 1024, unit: str = "chars"
) -> float:
    """A penalty in [-1, 0] for length beyond ``target``: 0 up to ``target``, -1 at ``max_length`` and beyond.

    Linear between (the DAPO overlong shaping when ``target`` is the soft limit). Combine it with a
    correctness reward through :func:`weighted_reward`.

    Args:
        response: The response text.
        ground_truth: Unused.
        target: Length with no penalty.
        max_length: Length at which the penalty reaches -1 (must exceed ``target``).
        unit: ``chars`` or ``words`` (whitespace-separated).
    """
    if max_length <= target:
        raise ValueError(f"length_penalty: max_length ({max_length}) must exceed target ({target})")
    if unit not in ("chars", "words"):
        raise ValueError(f"length_penalty: unit {unit!r} is not one of chars, words")
    length = len(response) if unit == "chars" else len(response.split())
    return -min(1.0, max(0.0, (length - target) / (max_length - target)))


def weighted_reward(response: str, ground_truth: Any, *, terms: Sequence[Mapping[str, Any]]) -> float:
    """Σ weight · reward over ``terms``, each ``{"fn": name or dotted path, "weight": w, "kwargs": {...}}``.

    Terms are scalar reward functions (built-ins or ``module:function``); e.g. ``math`` with weight 1 and
    ``format`` with weight 0.1.

    Raises:
        ValueError: A term without ``fn`` or with unknown keys.
    """
    from relax_core.rewards.registry import resolve_reward_fn  # the registry lists this function: import late

    total = 0.0
    for i, term in enumerate(terms):
        unknown = set(term) - {"fn", "weight", "kwargs"}
        if "fn" not in term or unknown:
            raise ValueError(f"weighted reward term {i}: needs 'fn' (and optionally weight, kwargs); got {dict(term)}")
        fn = resolve_reward_fn(str(term["fn"]))
        value = fn(response, ground_truth, **dict(term.get("kwargs", {})))
        total += float(term.get("weight", 1.0)) * float(value)
    return total

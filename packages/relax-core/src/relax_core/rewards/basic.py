"""Built-in reward functions: exact match, multiple-choice letter, numeric/math answer, format.

Each is a scalar reward function ``(response, ground_truth, **kwargs) -> float`` in [0, 1].
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

__all__ = [
    "exact_match_reward",
    "extract_boxed",
    "extract_choice",
    "format_reward",
    "math_reward",
    "multiple_choice_reward",
    "normalize_number",
]


def _normalise_text(text: str, case_sensitive: bool) -> str:
    text = " ".join(text.split())
    return text if case_sensitive else text.casefold()


def exact_match_reward(response: str, ground_truth: Any, *, case_sensitive: bool = False) -> float:
    """1.0 if the response equals the ground truth up to surrounding/repeated whitespace (and case)."""
    return float(_normalise_text(response, case_sensitive) == _normalise_text(str(ground_truth), case_sensitive))


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``) in ``text``, braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


_CHOICE_PATTERNS = (
    r"(?i:answer)\s*(?:(?i:is)|:)?\s*[:\-]?\s*\(?\**([A-Z])\b",
    r"\\boxed\{\s*\(?([A-Z])\)?\s*\}",
    r"\(([A-Z])\)",
)


def extract_choice(response: str, letters: str = "ABCDEFGHIJ") -> str | None:
    """The multiple-choice letter a response commits to.

    Looks, in order, for ``answer is C`` / ``Answer: (C)``, ``\\boxed{C}``, a parenthesised ``(C)``,
    and a response that is only the letter (``C``, ``C.``, ``C)``); within a pattern the last match
    wins. Only upper-case letters in ``letters`` count, except in a bare one-letter response.
    """
    for pattern in _CHOICE_PATTERNS:
        # Letters must be upper case so that words like "a" or "I" are not read as choices.
        found = [m for m in re.findall(pattern, response) if m in letters]
        if found:
            return str(found[-1]).upper()
    bare = re.fullmatch(r"\s*\(?([A-Za-z])[).:]?\s*", response)
    if bare and bare.group(1).upper() in letters:
        return bare.group(1).upper()
    return None


def multiple_choice_reward(response: str, ground_truth: Any, *, letters: str = "ABCDEFGHIJ") -> float:
    """1.0 if the extracted choice letter equals the ground-truth letter (case-insensitive)."""
    choice = extract_choice(response, letters)
    return float(choice is not None and choice == str(ground_truth).strip().strip("().").upper())


_UNIT_WORDS = re.compile(r"\\(?:text|mathrm|mbox)\{[^{}]*\}")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]+)\}\{([^{}]+)\}")
_NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:/\d+(?:\.\d+)?)?")


def normalize_number(text: str) -> Fraction | None:
    r"""Parse a numeric answer exactly: ``1,234``, ``\$3.50``, ``\frac{3}{4}``, ``3/4``, ``-2.5``,
    ``50\%``, ``12 \text{cm}``, ``x = 7``; None if it is not a single number.

    Units and LaTeX text wrappers are stripped; a percentage is kept as the number before ``%``.
    """
    s = _UNIT_WORDS.sub("", text)
    s = _FRAC.sub(r"(\1)/(\2)", s)
    s = s.replace("\\!", "").replace("\\,", "").replace("\\left", "").replace("\\right", "")
    s = (
        s.replace("\\$", "")
        .replace("$", "")
        .replace("\\%", "")
        .replace("%", "")
        .replace("^\\circ", "")
        .replace("°", "")
    )
    s = re.sub(r"^[^=]*=", "", s) if s.count("=") == 1 else s
    s = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s)  # thousands separators
    s = s.strip().rstrip(".")
    s = re.sub(r"\s*[A-Za-z]+\.?$", "", s).strip()  # trailing unit word (cm, dollars, kg)
    s = s.replace("(", "").replace(")", "").replace(" ", "")
    if not re.fullmatch(_NUMBER, s):
        return None
    numerator, _, denominator = s.partition("/")
    try:
        value = Fraction(numerator)
        return value / Fraction(denominator) if denominator else value
    except (ValueError, ZeroDivisionError):
        return None


def _final_answer(response: str) -> str:
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed
    marker = re.findall(r"(?:final answer|answer)\s*(?:is|:)\s*(.+)", response, flags=re.IGNORECASE)
    if marker:
        return str(marker[-1]).strip()
    numbers = re.findall(r"[-+]?\d[\d,]*(?:\.\d+)?(?:/\d+)?", response)
    return str(numbers[-1]) if numbers else response


def math_reward(response: str, ground_truth: Any, *, rel_tol: float = 1e-6) -> float:
    r"""1.0 if the response's final answer equals the ground truth.

    The final answer is the last ``\boxed{}``, else the text after "answer is"/"answer:", else the last
    number. Both sides are compared as exact numbers when they parse (within ``rel_tol``), otherwise
    as whitespace-free strings.
    """
    answer = _final_answer(response)
    got, want = normalize_number(answer), normalize_number(str(ground_truth))
    if got is not None and want is not None:
        scale = abs(want) if abs(want) > 1 else Fraction(1)
        return float(abs(got - want) <= Fraction(rel_tol) * scale)
    return float(re.sub(r"\s+", "", answer).strip("$.") == re.sub(r"\s+", "", str(ground_truth)).strip("$."))


DEFAULT_FORMAT = r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*"


def format_reward(response: str, ground_truth: Any = None, *, pattern: str = DEFAULT_FORMAT) -> float:
    """1.0 if the whole response matches ``pattern`` (default ``<think>…</think><answer>…</answer>``)."""
    return float(re.fullmatch(pattern, response, flags=re.DOTALL) is not None)

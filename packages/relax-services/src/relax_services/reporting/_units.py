"""Numbers for people: rates that never round a slow run to 0, durations, and an ETA that says when it is unknown."""

from __future__ import annotations

import math

__all__ = ["format_duration", "format_eta", "format_rate"]


def format_rate(per_s: float) -> str:
    """A rate with the digits it needs: ``1234``, ``12.3``, ``0.4``, ``0.043``; below 0.01 ``< 0.01``; 0 is ``0``."""
    if not math.isfinite(per_s) or per_s <= 0:
        return "0"
    if per_s >= 100:
        return f"{per_s:.0f}"
    if per_s >= 1:
        return f"{per_s:.1f}"
    if per_s >= 0.01:
        return f"{per_s:.2g}"
    return "< 0.01"


def format_duration(seconds: float) -> str:
    """``45s``, ``7m05s``, ``2h03m``."""
    whole = int(max(seconds, 0.0))
    if whole < 60:
        return f"{whole}s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def format_eta(step: int, eta_s: float | None) -> str:
    """The time left: unknown before the first update (``after the first update``: no update's duration is known
    yet), else :func:`format_duration` of ``eta_s`` (``?`` when not a number)."""
    if step == 0:
        return "after the first update"
    if eta_s is None or not math.isfinite(eta_s) or eta_s < 0:
        return "?"
    return format_duration(eta_s)

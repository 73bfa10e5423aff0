"""The figures a run keeps of a case's times: median, quartiles, extremes."""

from __future__ import annotations

import statistics

__all__ = ["summary"]


def summary(times):
    """{"median", "q1", "q3", "min", "max", "n"} of ``times``, None if empty."""
    if not times:
        return None
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median": statistics.median(times), "q1": q[0], "q3": q[2],
            "min": min(times), "max": max(times), "n": len(times)}

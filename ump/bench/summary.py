"""The figures a run keeps of a case's times: median, quartiles, extremes;
and each round's ratio to the same round of another configuration."""

from __future__ import annotations

import copy
import statistics

__all__ = ["summary", "summarised", "round_pairs", "round_ratios"]


def summary(times):
    """{"median", "q1", "q3", "min", "max", "n"} of ``times``, None if empty."""
    if not times:
        return None
    q = statistics.quantiles(times, n=4) if len(times) > 1 else [times[0]] * 3
    return {"median": statistics.median(times), "q1": q[0], "q3": q[2],
            "min": min(times), "max": max(times), "n": len(times)}


def summarised(results: dict) -> dict:
    """A copy of ``results`` (by case, then ``"suite"`` and each
    configuration's recorded times) with each entry's ``cpu`` and ``gpu``
    summaries, as a report keeps them; ``results`` itself is not changed,
    so the copy stays as it is while a run goes on adding to ``results``."""
    out = {}
    for case, per in results.items():
        out[case] = {"suite": per["suite"]}
        for config, e in per.items():
            if config != "suite":
                out[case][config] = {"cpu": summary(e["cpu_times"]), "gpu": summary(e["gpu_times"]),
                                     **copy.deepcopy(e)}
    return out


def round_pairs(entry, base, key):
    """(``entry``'s, ``base``'s) median of each round, for ``key`` ("cpu" or
    "gpu"). A round without a figure on either side (a failed run, a report
    that kept no rounds) gives none."""
    rounds = "round_cpu" if key == "cpu" else "round_gpu"
    return [(a, b) for a, b in zip(entry.get(rounds) or (), base.get(rounds) or ())
            if a is not None and b is not None]


def round_ratios(entry, base, key):
    """Each round's median of ``entry`` over the same round's of ``base``
    (:func:`round_pairs`): the spread that a ratio of medians hides when one
    process of a round runs slow throughout."""
    return [a / b for a, b in round_pairs(entry, base, key) if b]

"""Every figure of the report is a spread over repeats: min, median and max (and the samples themselves)."""

from __future__ import annotations

import statistics


def spread(samples) -> dict:
    """``{"min", "median", "max", "n", "samples"}`` of the samples (all None when there are none)."""
    values = [float(v) for v in samples if v is not None]
    if not values:
        return {"min": None, "median": None, "max": None, "n": 0, "samples": []}
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "n": len(values),
            "samples": values}


def not_measured(reason: str) -> dict:
    """A figure slot that was not measured in this run, with why."""
    return {"min": None, "median": None, "max": None, "n": 0, "samples": [], "not_measured": reason}


def run_in_turn(programs: dict, repeat: int) -> dict:
    """Call each of ``programs`` (name → no-argument callable) once and return name → result. Odd repeats call
    them in reverse order, so that a machine speeding up or slowing down within a repeat, or what the first
    program leaves behind (the page cache), does not always favour the same side of a ratio."""
    order = list(programs) if repeat % 2 == 0 else list(reversed(programs))
    return {name: programs[name]() for name in order}

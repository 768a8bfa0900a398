"""Robust summaries of repeated measurements on a noisy machine: medians and their spread."""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Dict, Optional, Sequence


@dataclass(frozen=True)
class Summary:
    """Median of the repeats and the spread around it (min, max, and relative half-range)."""

    median: float
    low: float
    high: float
    repeats: int

    @property
    def spread(self) -> float:
        """Half the min-max range relative to the median (0.05 means +-5%)."""
        return (self.high - self.low) / 2 / self.median if self.median else float("nan")

    def to_dict(self) -> Dict[str, float]:
        return {"median": self.median, "min": self.low, "max": self.high,
                "repeats": self.repeats, "spread": self.spread}


def summarize(values: Sequence[float]) -> Summary:
    if not values:
        raise ValueError("no measurements to summarize: did every repeat fail?")
    return Summary(statistics.median(values), min(values), max(values), len(values))


def ratio(numerator: Summary, denominator: Summary) -> float:
    """Ratio of medians; both were measured side by side in the same run."""
    return numerator.median / denominator.median if denominator.median else float("nan")


def median(values: Sequence[Optional[float]]) -> float:
    present = [v for v in values if v is not None and v == v]
    return summarize(present).median if present else float("nan")

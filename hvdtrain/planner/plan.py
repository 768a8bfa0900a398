"""``hvdtrain plan``: which strategy and mesh for this model on this cluster. MODELLED, NOT MEASURED.

Every layout that runs at the worker count (layout.py) is estimated, memory (memory.py) and step
time (step_time.py); the ones that fit the memory per worker are ranked by step time, the simpler
layout first on a tie. When none fits, the error says the memory per worker, or the worker count,
that would.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

from hvdtrain.common.errors import HvdtrainError
from hvdtrain.planner.layout import STRATEGIES, Estimate, Setup, layouts
from hvdtrain.planner.memory import memory
from hvdtrain.planner.network import LABEL
from hvdtrain.planner.step_time import estimate


def format_count(parameters: float) -> str:
    return f"{parameters / 1e9:.4g}B" if parameters >= 1e9 else f"{parameters / 1e6:.4g}M"


class NothingFits(HvdtrainError, ValueError):
    """No layout fits the memory per worker; the message says what would."""


@dataclass
class Plan:
    setup: Setup
    fitting: List[Estimate]          # by step time, fastest first
    too_big: List[Estimate] = field(default_factory=list)

    @property
    def recommended(self) -> Estimate:
        return self.fitting[0]

    def why(self) -> str:
        best = self.recommended
        text = (f"the fastest modelled step of the {len(self.fitting)} layout(s) that fit "
                f"({best.step_s * 1e3:.3g} ms, {best.total / self.setup.memory:.0%} of the memory)")
        if len(self.fitting) > 1:
            runner = self.fitting[1]
            tie = " (a tie: the simpler layout first)" if _rank(runner)[0] == _rank(best)[0] else ""
            text += f"; next: {runner.layout.name}, {runner.step_s / best.step_s - 1:+.0%} time{tie}"
        return text


def make_plan(setup: Setup) -> Plan:
    """Every layout's estimate; NothingFits (saying what would fit) when none fits the memory."""
    options = layouts(setup)
    if not options:
        raise NothingFits(f"no layout runs {setup.workers} workers on a global batch of {setup.batch}: the data "
                          f"replicas must share it evenly (choose a batch that is a multiple of the worker count)")
    estimates = [estimate(setup, layout) for layout in options]
    fitting = sorted((e for e in estimates if e.total <= setup.memory), key=_rank)
    if not fitting:
        raise NothingFits(what_would_fit(setup, estimates))
    return Plan(setup, fitting, [e for e in estimates if e.total > setup.memory])


def _rank(e: Estimate) -> Tuple[float, int, int]:
    """Fastest first; on a tie in modelled time, the simpler layout (no model split, then ddp before
    the sharding strategies): the model cannot tell them apart, and the simpler one has less to go wrong."""
    return (round(e.step_s, 12), e.layout.tensor * e.layout.pipeline * e.layout.sequence * e.layout.experts,
            STRATEGIES.index(e.layout.strategy))


def _smallest(setup: Setup, workers: int) -> Optional[Estimate]:
    options = [memory(setup, layout) for layout in layouts(setup, workers)]
    return min(options, key=lambda e: e.total, default=None)


def fewest_workers(setup: Setup, limit: int = 1 << 20) -> Optional[Estimate]:
    """The layout at the smallest worker count above ``setup.workers`` that fits its memory."""
    last = min(4 * setup.workers, setup.workers + 4096)  # every count up to there, then powers of two
    counts = list(range(setup.workers + 1, last + 1)) + [1 << k for k in range(64) if last < (1 << k) <= limit]
    for workers in counts:
        best = _smallest(setup, workers)
        if best is not None and best.total <= setup.memory:
            return best
    return None


def what_would_fit(setup: Setup, estimates: Sequence[Estimate]) -> str:
    from hvdtrain.common.units import format_bytes

    least = min(estimates, key=lambda e: e.total)
    text = (f"no layout fits {format_bytes(setup.memory)} per worker at {setup.workers} workers "
            f"({format_count(setup.shape.total)} parameters, {setup.optimizer}, {setup.precision}, global batch "
            f"{setup.batch}; {LABEL}). At {setup.workers} workers the least any layout needs is "
            f"{format_bytes(least.total)} per worker ({least.layout.name}): give each worker that much.")
    more = fewest_workers(setup)
    if more is None:
        return text + f" No worker count up to {1 << 20} fits {format_bytes(setup.memory)} per worker."
    workers = more.layout.ranks
    return text + (f" At {format_bytes(setup.memory)} per worker, the fewest workers that fit are {workers} "
                   f"({more.layout.name}: {format_bytes(more.total)} per worker).")

"""A model's layers cut into contiguous pipeline stages, from each layer's cost alone: the pipeline
(hvdtrain.parallel.pipeline.schedule, by parameter count) and the planner (by modelled elements) cut
the same way. Imports nothing but hvdtrain.common.errors."""
from __future__ import annotations

from typing import List, Optional, Sequence

from hvdtrain.common.errors import LayoutError


def contiguous_stages(costs: Sequence[float], stages: int, plan: Optional[Sequence[int]] = None) -> List[List[int]]:
    """The indices of the layers each stage holds, given each layer's cost: contiguous, every stage
    at least one layer, the largest stage's cost least, or ``plan[s]`` layers in stage ``s``."""
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"a pipeline needs a whole number >= 1 of stages, got {stages!r}")
    if len(costs) < stages:
        raise LayoutError(f"{len(costs)} layers cannot fill {stages} pipeline stages (each needs a layer): "
                         f"use at most {len(costs)} stages, or split the model into more layers")
    if plan is None:
        plan = _balanced_plan(list(costs), stages)
    else:
        plan = _check_plan(plan, len(costs), stages)
    starts = [sum(plan[:s]) for s in range(stages)]
    return [list(range(start, start + count)) for start, count in zip(starts, plan)]


def _check_plan(plan: Sequence[int], layers: int, stages: int) -> List[int]:
    plan = list(plan)
    if len(plan) != stages:
        raise ValueError(f"pipeline plan {plan} gives {len(plan)} stages, the pipeline has {stages}")
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in plan):
        raise ValueError(f"pipeline plan {plan}: every stage needs a whole number >= 1 of layers")
    if sum(plan) != layers:
        raise ValueError(f"pipeline plan {plan} covers {sum(plan)} layers, the model has {layers}: "
                         f"the layers per stage must add up to {layers}")
    return plan


def _balanced_plan(costs: List[float], stages: int) -> List[int]:
    """Layers per stage, contiguous, minimising the largest stage's cost (then the earliest
    stages lightest on ties): exact dynamic programming, the layer lists are short."""
    n = len(costs)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    inf = float("inf")
    # best[k][i]: the least largest cost of the first i layers in k stages; cut[k][i]: where the last stage starts.
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    plan, i = [], n
    for k in range(stages, 0, -1):
        j = cut[k][i]
        plan.append(i - j)
        i = j
    return plan[::-1]

"""Pipeline schedules as lists of actions, one list per stage, and a unit-time simulation of them.

A pipeline of P stages with v virtual stages (chunks) per stage cuts the model into P·v chunks;
chunk ``g`` lives on stage ``g % P`` (Narayanan et al. 2021: each stage holds v chunks spread over
the model, so a micro-batch visits every stage v times and the fill and drain shrink v-fold). An
action is one pass of one micro-batch through one chunk:

- ``F``: forward (needs the micro-batch's output of chunk g - 1);
- ``B``: backward (needs the gradient of chunk g + 1's input); the whole backward, or under the
  zero-bubble schedule only the input's gradient, what the previous chunk waits for;
- ``W``: the weight gradient left over by an input-only ``B`` (needs nothing from another stage,
  so it fills the time a stage would wait: Qi et al. 2023, "Zero Bubble Pipeline Parallelism").

Each stage runs its list in order; a pass's output is sent as soon as it exists and received when
a pass needs it. ``simulate`` runs the lists in unit time (every pass one unit unless told) and
proves them free of deadlock, which is what lets the executor post sends without waiting.
"""
from __future__ import annotations

from typing import Dict, List, NamedTuple, Sequence, Tuple


class Action(NamedTuple):
    """One pass: ``kind`` F, B or W, of ``micro_batch`` through global chunk ``chunk``."""

    kind: str
    micro_batch: int
    chunk: int


def check_interleaving(stages: int, virtual: int, micro_batches: int) -> None:
    """Refuse what the interleaved order cannot run: micro-batches go round the stages in groups of P."""
    if virtual > 1 and micro_batches % stages:
        raise ValueError(f"the interleaved 1F1B schedule (pipeline_virtual_stages={virtual}) sends micro-batches "
                         f"round the {stages} stages in groups of {stages}: {micro_batches} micro-batches are not a "
                         f"multiple of {stages}; choose micro_batches a multiple of pipeline_parallel={stages}")


def interleaved_actions(stages: int, virtual: int, micro_batches: int) -> List[List[Action]]:
    """Each stage's F and (whole) B passes in the interleaved 1F1B order (Megatron-LM's): forwards go
    over the stage's chunks in turn, P micro-batches at a time, and backwards the same way from its
    last chunk; a warm-up of ``2·(P - 1 - stage) + (v - 1)·P`` forwards, then one forward and one
    backward in turn. With v = 1 it is 1F1B (PipeDream-Flush)."""
    check_interleaving(stages, virtual, micro_batches)
    total = micro_batches * virtual

    def unit(k: int, backward: bool) -> Tuple[int, int]:
        group, within = divmod(k, stages * virtual)
        local = within // stages  # the stage's chunk, counted from its first (forward) or last (backward)
        return group * stages + k % stages, (virtual - 1 - local) if backward else local

    lists = []
    for stage in range(stages):
        if virtual == 1:
            warmup = min(stages - 1 - stage, total)
        else:
            warmup = min(2 * (stages - 1 - stage) + (virtual - 1) * stages, total)
        order: List[Action] = []

        def add(kind: str, k: int) -> None:
            micro_batch, local = unit(k, kind == "B")
            order.append(Action(kind, micro_batch, local * stages + stage))

        for k in range(warmup):
            add("F", k)
        for k in range(total - warmup):
            add("F", warmup + k)
            add("B", k)
        for k in range(total - warmup, total):
            add("B", k)
        lists.append(order)
    return lists


def zero_bubble_actions(stages: int, micro_batches: int) -> List[List[Action]]:
    """ZB-H1: 1F1B's order of F and input-only B, each W put off while the stage would otherwise
    wait (Qi et al. 2023; torch.distributed.pipelining's order): stage s keeps the W of its first s
    backward passes behind, then follows every B with the oldest W owed, and does the rest in the
    drain. Every stage holds at most P micro-batches (1F1B's peak, stage 0's); the bubble is a third
    of 1F1B's at F = B = W: (P - 1) units against 3·(P - 1)."""
    lists = []
    for stage, base in enumerate(interleaved_actions(stages, 1, micro_batches)):
        deferred = stage
        order: List[Action] = []
        pending: List[int] = []
        for action in base:
            order.append(action)
            if action.kind == "B":
                pending.append(action.micro_batch)
                if len(pending) > deferred:
                    order.append(Action("W", pending.pop(0), action.chunk))
        order.extend(Action("W", micro_batch, stage) for micro_batch in pending)
        lists.append(order)
    return lists


def schedule_actions(schedule: str, stages: int, virtual: int, micro_batches: int) -> List[List[Action]]:
    """Each stage's actions under ``schedule`` (1f1b, its interleaved form with v > 1, zb-h1; gpipe: every F, then every B).

    Args:
        schedule: gpipe, 1f1b or zb-h1.
        stages: P, the pipeline's stages.
        virtual: v, chunks per stage (v > 1 only with 1f1b).
        micro_batches: M, micro-batches per batch.
    """
    if schedule == "zb-h1":
        if virtual > 1:
            raise ValueError(f"the zb-h1 schedule runs one chunk per stage: set pipeline_virtual_stages=1 "
                             f"(got {virtual}), or use pipeline_schedule=1f1b to interleave")
        return zero_bubble_actions(stages, micro_batches)
    if schedule == "gpipe":
        if virtual > 1:
            raise ValueError(f"the gpipe schedule runs one chunk per stage: set pipeline_virtual_stages=1 "
                             f"(got {virtual}), or use pipeline_schedule=1f1b to interleave")
        return [[Action("F", i, s) for i in range(micro_batches)] + [Action("B", i, s) for i in range(micro_batches)]
                for s in range(stages)]
    if schedule == "1f1b":
        return interleaved_actions(stages, virtual, micro_batches)
    raise ValueError(f"unknown pipeline schedule {schedule!r}: choose one of gpipe, 1f1b, zb-h1")


def bubble_formula(schedule: str, stages: int, virtual: int, micro_batches: int) -> float:
    """The idle fraction each stage's step should show: (P - 1) / (v·M + P - 1) for gpipe and 1f1b
    (v = 1: not interleaved); for zb-h1 at F = B = W a third of 1F1B's idle time, over its shorter step:
    (P - 1) / (3·M + P - 1).

    Args:
        schedule: gpipe, 1f1b or zb-h1.
        stages: P, the pipeline's stages.
        virtual: v, chunks per stage.
        micro_batches: M, micro-batches per batch.
    """
    p, m = stages, micro_batches
    if schedule == "zb-h1":
        return (p - 1) / (3 * m + p - 1)
    return (p - 1) / (virtual * m + p - 1)


class Simulation(NamedTuple):
    """A unit-time run: the step's length, each stage's idle time within it, and the most
    micro-batch chunks each stage held at once (F done, its last backward pass not yet)."""

    makespan: float
    idle: List[float]
    held: List[int]

    def idle_fraction(self) -> List[float]:
        return [idle / self.makespan for idle in self.idle]


def simulate(lists: Sequence[Sequence[Action]], stages: int, chunks: int,
             costs: Dict[str, float] = None) -> Simulation:
    """Run each stage's list in order, each pass as soon as its stage is free and its input exists
    (sends never wait); ``costs`` per kind (default 1 each). Raises if the lists deadlock or leave
    out a pass.

    Args:
        lists: each stage's actions, in order.
        stages: P, the pipeline's stages.
        chunks: P·v, the model's chunks.
        costs: time units per kind of pass (F, B, W), default 1 each.
    """
    costs = {"F": 1.0, "B": 1.0, "W": 1.0, **(costs or {})}
    done: Dict[Action, float] = {}
    position = [0] * stages
    clock = [0.0] * stages
    busy = [0.0] * stages
    held = [0] * stages
    peak = [0] * stages
    split = any(a.kind == "W" for order in lists for a in order)
    while any(position[s] < len(lists[s]) for s in range(stages)):
        progressed = False
        for s in range(stages):
            while position[s] < len(lists[s]):
                action = lists[s][position[s]]
                need = _needs(action, chunks)
                if need is not None and need not in done:
                    break
                start = max(clock[s], done.get(need, 0.0)) if need is not None else clock[s]
                clock[s] = start + costs[action.kind]
                busy[s] += costs[action.kind]
                done[action] = clock[s]
                held[s] += 1 if action.kind == "F" else -1 if action.kind == ("W" if split else "B") else 0
                peak[s] = max(peak[s], held[s])
                position[s] += 1
                progressed = True
        if not progressed:
            stuck = {s: lists[s][position[s]] for s in range(stages) if position[s] < len(lists[s])}
            raise ValueError(f"the schedule deadlocks: stages wait on {stuck}")
    makespan = max(clock)
    return Simulation(makespan, [makespan - b for b in busy], peak)


def _needs(action: Action, chunks: int):
    """The pass (on this or another stage) whose output ``action`` takes; None: the micro-batch itself, or the loss."""
    if action.kind == "F":
        return Action("F", action.micro_batch, action.chunk - 1) if action.chunk > 0 else None
    if action.kind == "B":
        if action.chunk == chunks - 1:
            return Action("F", action.micro_batch, action.chunk)
        return Action("B", action.micro_batch, action.chunk + 1)
    return Action("B", action.micro_batch, action.chunk)

"""Training statistics kept on each rank without synchronising, and reduced across ranks on demand."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from hvdtrain.distributed import collectives
class RunningMeans:
    """Sums of weighted values (the loss, weighed by samples or its scored tokens; then the step's
    metrics, by samples), the sample count and the loss's weight since the last reduction, kept as
    one tensor on the training device: no .item() in the step, which would force a device sync on
    every step on a GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.names: List[str] = []  # known from the first batch on: "loss", then the metrics sorted
        self._totals = torch.zeros(2, dtype=torch.float64, device=device)  # count, loss weight, then the sums

    def add(self, loss: torch.Tensor, metrics: Mapping[str, Any], samples: int,
            loss_weight: Optional[int] = None) -> None:
        """One batch's loss and metrics, each weighed by ``samples``; the loss by ``loss_weight``
        instead when given.

        Args:
            loss: the batch's mean loss.
            metrics: the batch's means, by name (the same names every batch).
            samples: the batch's samples (0 on a rank that does not report for its replica).
            loss_weight: what the loss averages over (its scored tokens: token_mean), or None: samples.
        """
        names = ["loss", *sorted(metrics)]
        if not self.names:
            self.names = names
            self._totals = torch.zeros(len(names) + 2, dtype=torch.float64, device=self.device)
        elif names != self.names:
            raise ValueError(f"the step returned metrics {names[1:]} after {self.names[1:]}: it must "
                             "return the same metric names for every batch")
        values = [loss.detach()] + [torch.as_tensor(metrics[name]).detach() for name in names[1:]]
        weight = samples if loss_weight is None else loss_weight
        if weight == 0:  # nothing scored (a NaN mean over no token): it adds nothing
            values[0] = torch.zeros(())
        stacked = torch.stack([v.to(self.device, torch.float64).reshape(()) for v in values])
        self._totals[0] += samples
        self._totals[1] += weight
        self._totals[2] += stacked[0] * weight
        self._totals[3:] += stacked[1:] * samples

    def reduce(self, name: str, agree_on_names: bool = False) -> "Totals":
        """The sums and the sample count over every rank since the last reduction; a collective.

        ``agree_on_names``: a rank may have seen no batch (a short validation shard), so the
        ranks first tell each other the names (another collective)."""
        names = self.names
        if agree_on_names:
            every = collectives.allgather_object(names, name=f"{name}.names")
            names = next((n for n in every if n), [])
            if any(n and n != names for n in every):
                raise ValueError(f"the ranks' steps returned different metrics: {every}")
        totals = self._totals if self.names else torch.zeros(len(names) + 2, dtype=torch.float64)
        reduced = collectives.allreduce_sum(totals.cpu(), name=name).tolist()
        self._totals.zero_()
        return Totals(dict(zip(names, reduced[2:])), reduced[0], reduced[1])


@dataclass
class Totals:
    """Weighted sums over every rank's batches: the metrics weighed by samples, the loss by its own
    weight (samples, or the scored tokens); the sample count and the loss's total weight."""

    sums: Dict[str, float] = field(default_factory=dict)
    count: float = 0.0
    loss_weight: float = 0.0

    def __iadd__(self, other: "Totals") -> "Totals":
        for key, value in other.sums.items():
            self.sums[key] = self.sums.get(key, 0.0) + value
        self.count += other.count
        self.loss_weight += other.loss_weight
        return self

    def means(self) -> Dict[str, float]:
        def mean(key: str, value: float) -> float:
            weight = self.loss_weight if key == "loss" else self.count
            return value / weight if weight else float("nan")
        return {key: mean(key, value) for key, value in self.sums.items()}


class Throughput:
    """Global samples per second between two readings, and the share of that time spent
    waiting for the gradient all-reduce, timed on this rank's wall clock.

    Every step ends in the gradient all-reduce, so ranks advance in lockstep and rank 0's
    clock measures the job's rate.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._start = time.perf_counter()
        self._samples = 0
        self._waited = 0.0

    def add(self, samples_per_rank: int) -> None:
        self._samples += samples_per_rank * self.world_size

    def add_wait(self, seconds: float) -> None:
        self._waited += seconds

    def read(self) -> Tuple[float, float]:
        """(samples/s, fraction of the time spent waiting for communication) since the last read."""
        now = time.perf_counter()
        elapsed = max(now - self._start, 1e-9)
        rates = (self._samples / elapsed, min(1.0, self._waited / elapsed))
        self._start, self._samples, self._waited = now, 0, 0.0
        return rates

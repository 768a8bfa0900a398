"""Training statistics kept on each rank without synchronising, and reduced across ranks on demand."""
from __future__ import annotations

import time
from typing import Callable, Dict, Tuple

import torch

from hvdtrain import dist


class RunningLoss:
    """Sum of per-sample losses and the sample count since the last reset.

    Kept as a tensor on the training device: no .item() in the step, which would force a
    device sync on every step on a GPU.
    """

    def __init__(self, device: torch.device) -> None:
        self._totals = torch.zeros(2, dtype=torch.float64, device=device)

    def add(self, mean_loss: torch.Tensor, samples: int) -> None:
        self._totals[0] += mean_loss.detach().to(torch.float64) * samples
        self._totals[1] += samples

    def reduce(self, name: str) -> Tuple[float, float]:
        """(loss sum, sample count) over every rank since the last reset; a collective."""
        totals = dist.allreduce_sum(self._totals.cpu(), name=name)
        self._totals.zero_()
        return float(totals[0]), float(totals[1])


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


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, loss_fn, device: torch.device,
             after_batch: Callable[[], None] = lambda: None, lockstep: bool = False) -> Dict[str, float]:
    """Validation loss and accuracy over the whole validation set (every rank's shard; a collective).

    ``lockstep``: the model's forward is itself a collective (fsdp), so every rank runs as many
    forwards as the rank with the most batches; a rank with fewer repeats its last batch and
    does not count it (validation shards are not padded: each sample counts once).
    """
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    count = 0
    extra = 0
    if lockstep:
        counts = dist.allgather_object(len(loader), name="val.batches")  # every rank decides alike
        if min(counts) == 0:
            raise ValueError(f"validation batches per rank {counts}: with a sharded model every rank "
                             f"needs at least one; use fewer workers or a larger validation set")
        extra = max(counts) - len(loader)
    inputs = None
    for inputs, targets in loader:
        inputs, targets = inputs.to(device), targets.to(device)
        outputs = model(inputs)
        # Per target element: one per sample for a classifier, one per token for a language model.
        loss_sum += loss_fn(outputs, targets).to(torch.float64) * targets.numel()
        correct += (outputs.argmax(dim=-1) == targets).sum()
        count += targets.numel()
        after_batch()
    for _ in range(extra):  # lockstep: the last batch again, not counted
        model(inputs)
    return evaluation_metrics(float(loss_sum), int(correct), count, name="val.metrics")


def evaluation_metrics(loss_sum: float, correct: int, count: int, name: str) -> Dict[str, float]:
    """Loss and accuracy over the union of every rank's shard (summed, not an average of averages)."""
    totals = dist.allreduce_sum(
        torch.tensor([loss_sum, float(correct), float(count)], dtype=torch.float64), name=name
    )
    total_count = float(totals[2])
    if total_count == 0:
        raise ValueError("the validation set is empty on every rank")
    return {
        "val_loss": float(totals[0]) / total_count,
        "val_accuracy": float(totals[1]) / total_count,
        "val_samples": total_count,
    }

"""One process's training, the standard a layout is held to, and the comparison with it.

The same global batches the Trainer's sampler gives the layout (ShardedSampler's global order, one
step's global batch after another), the same optimizer, in one process without Horovod, from the
values the layout started from (gathered after its set-up). Run it inside ``float64_throughout()``
as the layout is run.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Tuple

import torch
from torch.utils.data import TensorDataset

from hvdtrain.data.sharding import ShardedSampler

OPTIMIZERS = ("adamw", "sgd")
# AdamW's step is about lr whatever the gradient; plain SGD's is lr x the gradient, small on a tiny
# model initialized at 0.02: its larger rate makes a gradient counted twice or dropped show.
RATES = {"adamw": 1e-2, "sgd": 1e-1}
SAMPLES, BATCH = 64, 4  # token sequences in the data set; each worker's batch


def make_optimizer(name: str, parameters) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(parameters, lr=RATES[name])
    if name == "sgd":
        return torch.optim.SGD(parameters, lr=RATES[name])
    raise ValueError(f"unknown optimizer {name!r}: choose one of {', '.join(OPTIMIZERS)}")


def token_data(vocabulary: int, sequence: int, samples: int = SAMPLES) -> TensorDataset:
    """Random token ids and the next token of each as its label, the same on every rank."""
    ids = torch.randint(0, vocabulary, (samples, sequence + 1), generator=torch.Generator().manual_seed(3))
    return TensorDataset(ids[:, :-1], ids[:, 1:])


def logits_loss(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits: a model's output's, or a pipeline's last stage's (the logits)."""
    logits = getattr(outputs, "logits", outputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def one_process(model: torch.nn.Module, initial: Mapping[str, torch.Tensor], data: TensorDataset, seed: int,
                global_batch: int, steps: int, optimizer: str) -> Tuple[Dict[str, torch.Tensor], List[float]]:
    """(the final state, each step's loss) of ``model`` trained from ``initial`` in this process alone.

    Args:
        model: the model, loaded with ``initial``.
        initial: the starting state.
        data: the whole data set.
        seed: the sampler's seed, as the run's.
        global_batch: samples per step.
        steps: optimizer steps.
        optimizer: the optimizer's name.
    """
    model.load_state_dict(initial)
    step = make_optimizer(optimizer, model.parameters())
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=seed)
    sampler.set_epoch(0)
    order = list(sampler)
    inputs, targets = data.tensors
    losses = []
    for i in range(steps):
        batch = order[i * global_batch:(i + 1) * global_batch]
        step.zero_grad()
        loss = logits_loss(model(input_ids=inputs[batch]), targets[batch])
        loss.backward()
        step.step()
        losses.append(loss.item())
    return {name: value.detach().clone() for name, value in model.state_dict().items()}, losses


@dataclasses.dataclass
class Comparison:
    max_diff: float
    loss_diff: float
    moved: float
    parameter: Optional[str] = None  # the first past the tolerance, in the model's order
    parameter_diff: Optional[float] = None
    parameter_size: Optional[float] = None

    def equal(self, tolerance: float) -> bool:
        return self.max_diff < tolerance and self.loss_diff < tolerance


def compare(final: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
            initial: Mapping[str, torch.Tensor], losses: List[float], expected_losses: List[float],
            tolerance: float) -> Comparison:
    """How far a layout's final state and losses are from one process's.

    Args:
        final: the layout's final state, gathered whole.
        expected: one process's final state.
        initial: the starting state, to tell how far training moved.
        losses: the layout's per-step losses.
        expected_losses: one process's.
        tolerance: the largest difference that counts as equal.
    """
    missing = sorted(set(expected) ^ set(final))
    if missing:
        raise ValueError(f"the layout's gathered state and one process's hold different names: {missing[:5]}")
    diffs = {name: _max_abs(final[name], expected[name]) for name in expected}
    first = next((name for name, diff in diffs.items() if not diff < tolerance), None)  # NaN counts as past
    loss_diff = max((abs(a - b) for a, b in zip(losses, expected_losses)), default=float("inf"))
    if len(losses) != len(expected_losses):
        loss_diff = float("inf")
    return Comparison(max_diff=max(diffs.values(), default=0.0), loss_diff=loss_diff,
                      moved=max((_max_abs(expected[n], initial[n]) for n in expected), default=0.0),
                      parameter=first, parameter_diff=diffs[first] if first else None,
                      parameter_size=expected[first].abs().max().item() if first and expected[first].numel() else None)


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else float("inf")
    if not a.numel():
        return 0.0
    diff = (a.double() - b.double()).abs().max().item()
    return diff if diff == diff else float("inf")  # a NaN is as far as it gets

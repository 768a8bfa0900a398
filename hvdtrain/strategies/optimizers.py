"""The user's optimizer, on other parameters: which optimizers may step slices of tensors, and a new
optimizer of the user's class and hyperparameters over given parameters (shards, a stage's)."""
from __future__ import annotations

import inspect
from typing import List, Sequence

import torch

# Stepping a flat slice that cuts across parameters (or a slice of a matrix) equals stepping each
# whole parameter only when the update of every element depends on that element alone.
ELEMENTWISE_OPTIMIZERS = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
    torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.ASGD, torch.optim.Rprop,
    torch.optim.Adadelta,
)


def check_elementwise(optimizer: torch.optim.Optimizer, refused: str, why: str, way_out: str) -> None:
    """ValueError unless ``optimizer`` is elementwise (a local check: the same verdict on every rank).
    The three messages are the caller's words; ``{name}`` in them is the class's name.

    Args:
        optimizer: the user's optimizer.
        refused: what is refused.
        why: why an optimizer that is not elementwise cannot do it.
        way_out: what to do instead.
    """
    if isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        return
    name = type(optimizer).__name__
    supported = ", ".join(cls.__name__ for cls in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"{refused.format(name=name)}: {why}, which gives one process's result only for elementwise "
        f"optimizers ({supported} and their subclasses). {name} is not one of them: optimizers such as "
        f"LBFGS, Adafactor and Muon look at whole tensors (a line search over all of them, a matrix's row "
        f"and column statistics, its orthogonalisation). {way_out.format(name=name)}")


def optimizer_like(optimizer: torch.optim.Optimizer,
                   groups: Sequence[List[torch.nn.Parameter]]) -> torch.optim.Optimizer:
    """A new optimizer of the user's class and hyperparameters, ``groups[g]`` in place of group g's
    parameters."""
    param_groups = [{**{k: v for k, v in group.items() if k != "params"}, "params": list(params)}
                    for group, params in zip(optimizer.param_groups, groups)]
    accepted = inspect.signature(type(optimizer).__init__).parameters
    # The groups carry every hyperparameter; defaults only serve subclasses that require some.
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    return type(optimizer)(param_groups, **defaults)


def repoint_optimizer(optimizer: torch.optim.Optimizer, groups: Sequence[List[torch.nn.Parameter]]) -> None:
    """``optimizer`` over ``groups[g]`` in place of group g's parameters, its state dropped: the
    same object, so what drives it (the LR schedule) goes on driving it."""
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = list(params)
    optimizer.state.clear()

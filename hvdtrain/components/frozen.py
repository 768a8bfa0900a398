"""A second model your loop runs but does not train (a distillation teacher, a frozen reference):
rank 0's weights on every rank, on the rank's device, in evaluation mode, without gradients. It is
replicated whole on each rank under every strategy (never sharded), and it is not in checkpoints:
the script builds or loads it again on every start.
"""
from __future__ import annotations

from typing import Iterable, List, Tuple

import torch

from hvdtrain.distributed import collectives


def layout(model: torch.nn.Module) -> List[Tuple[str, Tuple[int, ...], str]]:
    """Every state entry's name, shape and dtype: what every rank must agree on before a broadcast."""
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()]


def prepare_frozen(model: torch.nn.Module, device: torch.device, trained: Iterable[torch.Tensor],
                   name: str) -> torch.nn.Module:
    """``model`` on ``device`` with rank 0's parameters and buffers, eval(), requires_grad off; every
    rank calls it. Refused on every rank alike (before the broadcast, which would otherwise pair
    mismatched tensors or wait forever) when a rank's model differs in its layout, when it is on the
    meta device, or when the session's optimizer trains any of its parameters.

    Args:
        model: the model to run untrained, built alike on every rank (its weights may differ).
        device: this rank's device.
        trained: the tensors the session trains (its model's and its optimizer's parameters).
        name: the user's call, named in the errors.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{name}(model): an nn.Module, got {type(model).__name__}")
    trained_ids = {id(t) for t in trained}
    problem = None
    if any(p.is_meta for p in model.parameters()):
        problem = (f"{name}(model): its parameters are on the meta device: load or initialize its weights "
                   f"first (a frozen model is not initialized by the session)")
    elif any(id(p) in trained_ids for p in model.parameters()):
        problem = (f"{name}(model): the session's optimizer trains its parameters: it is the model setup() "
                   f"was given (hv.model), or shares parameters with it; give a model that is not trained")
    problems = collectives.allgather_object(problem, name="frozen.problem")
    if any(problems):
        raise ValueError(next(p for p in problems if p))
    layouts = collectives.allgather_object(layout(model), name="frozen.layout")
    differing = [rank for rank, found in enumerate(layouts) if found != layouts[0]]
    if differing:
        raise ValueError(f"{name}(model): ranks {differing} built a model whose state names, shapes or dtypes "
                         f"differ from rank 0's: build the same model on every rank (its weights may differ: "
                         f"rank 0's are broadcast)")
    model.to(device)
    state = collectives.broadcast_state(model.state_dict(), root_rank=0, name="frozen.state")
    model.load_state_dict(state)
    model.requires_grad_(False)
    return model.eval()

"""The first step's proof that a tensor split counts every contribution once, before any update.

Under tensor parallelism every parameter is either split (each rank holds a slice, and its
gradient is that slice's) or kept whole on every rank of the tensor group. A whole parameter
is right in exactly two ways:

- it sees the same input on every rank (a norm after a row-parallel layer's sum, a router, the
  final norm): its gradient is then the same on every rank, with nothing to add;
- it sees only this rank's part (a per-head norm behind a column-parallel projection): each
  rank's gradient is then a part, and the plan must sum them (``replicated_with_grad_allreduce``).

A plan that leaves the second kind unsummed trains each rank's copy on a part, and one that sums
the first kind counts the gradient T times: either trains silently to other weights. So on the
first step, after backward and before the optimizer, every rank of the tensor group shows the
others a fingerprint of each whole parameter's gradient (and of the loss, which every rank computes
from the same gathered output) and of each summed one's part before its sum: the whole ones must
agree (the summed ones too, once summed: a rank whose sum did not run differs), the summed parts
must not all be equal. Anything else is refused by name on every rank,
before anything is stepped. It costs one all-gather of a few numbers per parameter, once.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch
from torch import nn

# Whole parameters compute the same operations on the same values on every rank: their gradients
# agree bitwise, but for kernels whose order of additions is not fixed (a GPU's atomic adds in an
# embedding's backward), which move a sum by ~1e-7 of its size in float32 and ~1e-2 in bf16. A wrong
# split gives every rank a different part: fingerprints apart by their own size. By the gradient's dtype:
AGREE = {torch.float64: 1e-9, torch.float32: 1e-4}
AGREE_LOW_PRECISION = 5e-2  # float16, bfloat16
# A summed parameter's parts: equal on every rank only when every rank saw the same input.
SAME_PART = 1e-12
PRINTS = 3


def fingerprint(tensor: Optional[torch.Tensor], device: torch.device) -> torch.Tensor:
    """(sum, sum of squares, sum against a fixed ramp) in float64: numbers that tell different
    gradients apart (the ramp, the same on every rank, separates permuted or sign-flipped parts)."""
    if tensor is None:
        return torch.zeros(PRINTS, dtype=torch.float64, device=device)
    values = tensor.detach().reshape(-1).double()
    ramp = torch.linspace(-1.0, 1.0, values.numel(), dtype=torch.float64, device=values.device)
    return torch.stack([values.sum(), values.square().sum(), (values * ramp).sum()]).to(device)


class SplitAudit:
    """Checks the first step of a model split over ``group`` (a mesh Group with a process set):
    ``summed`` names the parameters whose gradients are summed over the group (the plan's, and those
    inside a split region: tensor_region; their hooks report each part through ``observe_part``
    first), ``watch`` gives those this rank holds whole."""

    def __init__(self, group: Any, summed: Sequence[str], device: torch.device) -> None:
        self.group, self.device = group, device
        self.summed = set(summed)
        self.whole: List[Tuple[str, nn.Parameter]] = []
        self.parts: Dict[str, torch.Tensor] = {}
        self.loss: Optional[torch.Tensor] = None
        self.armed = True

    def watch(self, whole: Sequence[Tuple[str, nn.Parameter]]) -> None:
        """The parameters this rank holds whole and trains, the summed ones among them (their
        gradients, once summed, must agree like the others')."""
        self.whole = list(whole)

    def observe_part(self, name: str, grad: torch.Tensor) -> None:
        """A summed parameter's gradient on this rank, before the sum (its hook calls this)."""
        if self.armed:  # (accumulated micro-batches add up, as their gradients do)
            self.parts[name] = self.parts.get(name, 0) + fingerprint(grad, self.device)

    def observe_loss(self, loss: torch.Tensor) -> None:
        if self.armed:
            self.loss = loss.detach()

    def check(self, every_rank: Any) -> None:
        """After the first step's backward, on every rank (a collective over the tensor group, then
        over ``every_rank``, a process set or None for the world): ValueError on every rank if any
        tensor group found a contribution counted otherwise than once. Later steps: nothing."""
        if not self.armed:
            return
        self.armed = False
        summed = sorted(self.summed)
        rows = ([fingerprint(self.loss, self.device)] + [fingerprint(p.grad, self.device) for _, p in self.whole]
                + [self.parts.get(name, fingerprint(None, self.device)) for name in summed])
        mine = torch.stack(rows).reshape(1, -1)
        every = hvd.allgather(mine, name="tp.audit.fingerprints", process_set=self.group.process_set)
        every = every.reshape(self.group.size, len(rows), PRINTS).cpu()
        whole = [("the loss", self.loss)] + [(name, p.grad) for name, p in self.whole]
        problems = self._problems(every, whole, summed)
        # Every rank of the world raises alike, whichever tensor group found it (no rank left waiting).
        flagged = torch.tensor([1.0 if problems else 0.0], dtype=torch.float64, device=self.device)
        kwargs = {} if every_rank is None else {"process_set": every_rank}
        if hvd.allreduce(flagged, op=hvd.Max, name="tp.audit.verdict", **kwargs).item() == 0:
            return
        if not problems:
            raise ValueError("tensor parallelism: another tensor group found a contribution counted otherwise "
                             "than once on the first step (its ranks name it); nothing was stepped")
        raise ValueError("tensor parallelism would train another model than one process (found on the first "
                         "step, before any update): " + "; ".join(problems[:3]))

    def _problems(self, every: torch.Tensor, whole: List[Tuple[str, Optional[torch.Tensor]]],
                  summed: List[str]) -> List[str]:
        problems = []
        for i, (name, value) in enumerate(whole):
            values = every[:, i, :]
            spread = (values - values[0]).abs().max().item()
            dtype = value.dtype if value is not None else torch.float64
            if spread > AGREE.get(dtype, AGREE_LOW_PRECISION) * max(values[0].abs().max().item(), 1e-300):
                if name in self.summed:
                    problems.append(f"the gradient of {name}, summed over the tensor group, still differs between "
                                    f"its ranks (by {spread:.3g}): some rank's sum did not run")
                    continue
                what = "the loss differs" if i == 0 else f"the gradient of {name}, kept whole, differs"
                problems.append(
                    f"{what} between the ranks of the tensor group (by {spread:.3g}): it sees only each rank's "
                    f"part of an activation (a per-head norm behind a column-parallel projection, say). Give "
                    f"its module the style replicated_with_grad_allreduce, or keep the layer that feeds it whole")
        for j, name in enumerate(summed, start=len(whole)):
            values = every[:, j, :]
            spread = (values - values[0]).abs().max().item()
            if values[0].abs().max().item() > 0 and spread <= SAME_PART * values[0].abs().max().item():
                problems.append(
                    f"the gradient of {name} is summed over the tensor group (replicated_with_grad_allreduce), "
                    f"but every rank's part is the same: it sees the whole input, and the sum counts it "
                    f"{self.group.size} times. Leave its module out of the plan")
        return problems

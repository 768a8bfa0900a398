"""Two checkpoints of any layouts compared tensor by tensor, bitwise, through the tensor sources
(hvdtrain.checkpoint.sources.contract): a sharded one of 2 ranks against one of 4 or of another
strategy, a mesh's, a full one, or a Hugging Face weights directory (model only). Every tensor is
put together whole, one at a time, so no more than two tensors are held at once.

Bitwise: the elements' bytes are compared, so -0.0 differs from 0.0 and a NaN equals the same NaN.
A difference is named by tensor, with its first differing element and the largest absolute
difference; the optimizer's state is compared by the optimizer's parameter index (a full checkpoint
knows no other name), named by parameter where either source can.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Mapping, Optional, Sequence

import torch

from hvdtrain.checkpoint.sources.contract import TensorSource


@dataclass(frozen=True)
class Difference:
    what: str  # the tensor or value: "model blocks.0.weight", "optimizer exp_avg of parameter 3 (blocks.0.weight)"
    how: str  # "only in A", "float32 of shape [4] in A, float64 of shape [4] in B", "first at ..., max |A - B| ..."

    def __str__(self) -> str:
        return f"{self.what}: {self.how}"


@dataclass
class Comparison:
    differences: List[Difference]
    tensors: int  # how many tensors were compared
    notes: List[str]  # what was not compared, and why

    @property
    def identical(self) -> bool:
        return not self.differences


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    """How ``a`` and ``b`` differ (dtype, shape, or the first differing element and the largest
    absolute difference), or "" when they are bitwise the same."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return f"{_describe(a)} in A, {_describe(b)} in B"
    flat_a, flat_b = a.detach().reshape(-1).contiguous(), b.detach().reshape(-1).contiguous()
    if flat_a.numel() == 0:
        return ""
    element = flat_a.element_size()
    differs = (flat_a.view(torch.uint8).reshape(-1, element) != flat_b.view(torch.uint8).reshape(-1, element)).any(1)
    if not bool(differs.any()):
        return ""
    first = int(differs.nonzero()[0])
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(a.shape))) if a.dim() > 1 else first
    if flat_a.is_complex():
        gap = (flat_a - flat_b).abs()
    else:
        gap = (flat_a.to(torch.float64) - flat_b.to(torch.float64)).abs()
    count = int(differs.sum())
    return (f"{count} of {flat_a.numel()} elements differ, the first at index {where} ({flat_a[first].item()} in A, "
            f"{flat_b[first].item()} in B), max |A - B| {float(gap.max()):.6g}")


def compare(a: TensorSource, b: TensorSource) -> Comparison:
    """Every model tensor of ``a`` and ``b`` (a tied one under any of its names), then, where both
    hold optimizer state, its hyperparameters and every parameter's state entries."""
    result = Comparison([], 0, [])
    _compare_model(a, b, result)
    if a.parameter_count() is None or b.parameter_count() is None:
        result.notes.append(f"optimizer state not compared: {'A' if a.parameter_count() is None else 'B'} holds "
                            f"none (model only)")
    else:
        _compare_optimizer(a, b, result)
    return result


def _compare_model(a: TensorSource, b: TensorSource, result: Comparison) -> None:
    tied = {name: names for source in (a, b) for names in source.aliases().values() for name in names}
    seen_in_b = set()
    for name in a.model_keys:
        names = [name] + [other for other in tied.get(name, []) if other != name]
        held = next((other for other in names if b.holds(other)), None)
        if held is None:
            result.differences.append(Difference(f"model {name}", "only in A"))
            continue
        seen_in_b.update(names)
        result.tensors += 1
        how = tensor_difference(a.full_tensor(name), b.full_tensor(held))
        if how:
            result.differences.append(Difference(f"model {name}", how))
    for name in b.model_keys:
        if name not in seen_in_b and not any(a.holds(other) for other in tied.get(name, [name])):
            result.differences.append(Difference(f"model {name}", "only in B"))


def _compare_optimizer(a: TensorSource, b: TensorSource, result: Comparison) -> None:
    count_a, count_b = a.parameter_count(), b.parameter_count()
    if count_a != count_b:
        result.differences.append(Difference("optimizer", f"{count_a} parameters in A, {count_b} in B"))
        return
    groups_a, groups_b = a.param_groups(), b.param_groups()
    if len(groups_a) != len(groups_b):
        result.differences.append(Difference("optimizer", f"{len(groups_a)} parameter groups in A, "
                                                          f"{len(groups_b)} in B"))
    for g, (group_a, group_b) in enumerate(zip(groups_a, groups_b)):
        for key in sorted(set(group_a) & set(group_b) - {"params"}):
            if not _same_value(group_a[key], group_b[key]):
                result.differences.append(Difference(f"optimizer param_groups[{g}] {key}",
                                                     f"{group_a[key]!r} in A, {group_b[key]!r} in B"))
    names_a, names_b = a.optimizer_parameter_names(), b.optimizer_parameter_names()
    for index in range(count_a):
        name_a, name_b = (names_a[index] if names_a else ""), (names_b[index] if names_b else "")
        label = f"parameter {index}" + (f" ({name_a or name_b})" if name_a or name_b else "")
        state_a, state_b = a.optimizer_state_of(index, name_a) or {}, b.optimizer_state_of(index, name_b) or {}
        for key in list(state_a) + [key for key in state_b if key not in state_a]:
            what = f"optimizer {key} of {label}"
            if key not in state_b or key not in state_a:
                result.differences.append(Difference(what, f"only in {'A' if key in state_a else 'B'}"))
                continue
            how = _value_difference(state_a[key], state_b[key])
            result.tensors += isinstance(state_a[key], torch.Tensor)
            if how:
                result.differences.append(Difference(what, how))


def _value_difference(a: Any, b: Any) -> str:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return tensor_difference(a, b)
    return "" if _same_value(a, b) else f"{a!r} in A, {b!r} in B"


def _same_value(a: Any, b: Any) -> bool:
    """Plain values (hyperparameters, scalars) equal; a tensor against a tensor bitwise; a tuple
    equals the list JSON made of it (a manifest's param_groups hold lists)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and not tensor_difference(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(_same_value(a[k], b[k]) for k in a)
    return a == b


def _describe(tensor: torch.Tensor) -> str:
    return f"{str(tensor.dtype).replace('torch.', '')} of shape {list(tensor.shape)}"


def summary(result: Comparison, limit: Optional[int] = 20) -> Sequence[str]:
    """The lines a report prints: each difference (the first ``limit``; None: all)."""
    lines = [str(difference) for difference in result.differences[:limit]]
    if limit is not None and len(result.differences) > limit:
        lines.append(f"... and {len(result.differences) - limit} more")
    return lines

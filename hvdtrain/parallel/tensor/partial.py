"""transformers' ``all_reduce``: a module run on its own cut bare parameters, its output a partial sum.

Inkling's shared experts hold bare 3-D parameters (n_shared, intermediate, hidden) for gate_proj and
up_proj and (n_shared, hidden, intermediate) for down_proj, each cut by its own plan entry (colwise:
dim ndim - 2, rowwise: the last dim; transformers' ColwiseParallel / RowwiseParallel shard_param),
and mark the module ``all_reduce`` (AllReduceParallel): its forward runs on this rank's intermediate
slice, so its output is this rank's part of a sum, all-reduced after the forward. That is Megatron's
g; and, the output being a sum over the ranks of functions of the same inputs, each rank's gradient
of every input is a part too: summed over the group in backward (f), for every floating input (the
hidden states, and the routing weights Inkling's forward scales by).

Only a module whose every parameter is its own, cut by an entry, is taken: a whole parameter (a
scale) or a layer inside would be counted once per rank by the sum, or summed twice. Whether the
cuts make the forward a partial sum is proven as for every split: the set-up probe compares the
logits with the whole model's, the first step's audit the gradients.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping

import torch
from torch import nn

from hvdtrain.parallel.tensor.layers import SumOutput, _shard, copy_to_tensor_group, is_placeholder, own_copy
from hvdtrain.parallel.tensor.shard import TensorShard

PARTIAL_STYLES = ("all_reduce",)


def partial_cut_dim(style: str, ndim: int) -> int:
    """The dim transformers cuts a parameter of ``ndim`` dims along for ``style`` (colwise: its
    output rows, ndim - 2; rowwise: its input columns, the last)."""
    return ndim - 2 if style == "colwise" else ndim - 1


def check_partial_module(path: str, module: nn.Module, cuts: Mapping[str, str], size: int) -> None:
    """ValueError naming ``path`` when ``all_reduce`` cannot split ``module``.

    Args:
        path: the module's path in the model.
        module: the module.
        cuts: the plan's styles of its own parameters, attribute -> style.
        size: ranks in the tensor group.
    """
    name = type(module).__name__
    if any(True for child in module.children() for _ in child.parameters()):
        raise ValueError(f"tensor plan: {path} ({name}, all_reduce) holds layers with parameters: hvdtrain sums the "
                         f"output of a module running on its own cut bare parameters only (a split layer inside would "
                         f"be summed twice, a whole one counted once per rank). Leave {path} out of the plan")
    own = dict(module.named_parameters(recurse=False))
    if not own:
        raise ValueError(f"tensor plan: {path} ({name}, all_reduce) has no parameters of its own to cut: its output "
                         f"would be whole on every rank and the sum would count it {size} times")
    whole = sorted(set(own) - set(cuts))
    if whole:
        raise ValueError(f"tensor plan: {path} ({name}, all_reduce): no entry cuts {', '.join(whole)}; a whole "
                         f"parameter's contribution would be counted once per rank by the sum. Give each of its "
                         f"parameters an entry (colwise or rowwise) or leave {path} out of the plan")
    for attribute, style in cuts.items():
        parameter = own[attribute]
        if style not in ("colwise", "rowwise"):
            raise ValueError(f"tensor plan: {path}.{attribute} is cut as {style!r}; inside an all_reduce module "
                             f"hvdtrain cuts parameters colwise or rowwise")
        if parameter.dim() < 2:
            raise ValueError(f"tensor plan: {path}.{attribute} has shape {tuple(parameter.shape)}: inside an "
                             f"all_reduce module hvdtrain cuts weights of 2 or more dims (how a forward sums a cut "
                             f"vector is unknown)")
        dim = partial_cut_dim(style, parameter.dim())
        if parameter.shape[dim] % size:
            raise ValueError(f"tensor plan: {path}.{attribute} ({style}) has {parameter.shape[dim]} along dim {dim}, "
                             f"not divisible by tensor_parallel={size}")
        if hasattr(parameter, "tensor_shard"):
            raise ValueError(f"tensor plan: {path}.{attribute} is already split: parallelize once")
        if parameter.is_meta and not is_placeholder(parameter):
            raise ValueError(f"tensor plan: {path}.{attribute} is on the meta device without a placeholder: "
                             f"nothing to cut")


def owned_cuts(path: str, named: Mapping[str, str]) -> Dict[str, str]:
    """``path``'s own parameters among ``named`` (parameter path -> style): attribute -> style."""
    return {parameter.rpartition(".")[2]: style for parameter, style in named.items()
            if parameter.rpartition(".")[0] == path}


def split_partial_module(module: nn.Module, cuts: Mapping[str, str], group: Any, path: str) -> nn.Module:
    """A copy of ``module`` (its class, its forward) holding this rank's slice of each parameter the
    plan cuts, its floating inputs' gradients summed over the group (f) and its output summed over
    the group (g). The module as built is left as it was.

    Args:
        module: the module.
        cuts: the plan's styles of its own parameters, attribute -> style.
        group: the tensor group.
        path: its path in the model, naming its collectives.
    """
    split = own_copy(module)
    for attribute, style in cuts.items():
        whole = module._parameters[attribute]
        shard = TensorShard(dim=partial_cut_dim(style, whole.dim()), parts=group.size, index=group.index)
        split._parameters[attribute] = _shard(whole, shard)
    split.register_forward_pre_hook(_SumInputGradients(group, path), with_kwargs=True)
    split.register_forward_hook(SumOutput(group, path))
    return split


class _SumInputGradients:
    """f on every floating input: each rank's part of the sum gives a part of its gradient."""

    def __init__(self, group: Any, name: str) -> None:
        self.group, self.name = group, name

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict):
        args = tuple(self._f(x, f"arg{position}") for position, x in enumerate(args))
        kwargs = {key: self._f(x, key) for key, x in kwargs.items()}
        return args, kwargs

    def _f(self, x: Any, input_name: str) -> Any:
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            return x
        return copy_to_tensor_group(x, self.group, f"tp.f.{self.name}.{input_name}")


def partial_parameter_entries(named: Mapping[str, str], chosen: Mapping[str, str]) -> List[str]:
    """The parameter paths among ``named`` whose module the plan gives ``all_reduce``."""
    return [parameter for parameter in named if chosen.get(parameter.rpartition(".")[0]) in PARTIAL_STYLES]

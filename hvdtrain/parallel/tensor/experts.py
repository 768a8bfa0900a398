"""Mixture-of-experts under tensor parallelism: Hugging Face's ``moe_tp_experts``, split as transformers splits it.

transformers 5 keeps a family's experts (Qwen2-MoE, Qwen3-MoE, Mixtral, ...) fused in one module with
3-D parameters, ``gate_up_proj`` (experts, 2 x intermediate, hidden: [gate; up]) and ``down_proj``
(experts, hidden, intermediate), and its plan names them twice: the parameters by their own entries
(``...experts.gate_up_proj: packed_colwise``, ``...experts.down_proj: rowwise``) and the module
(``...experts: moe_tp_experts``). transformers then cuts every expert's intermediate dimension over
the tensor group (gate and up alike), runs the module's own forward on the slices, and sums the
experts' outputs over the group; each rank's gradients of the experts' inputs (the hidden states and
the routing weights) are parts, summed in backward. That is Megatron's f and g around each expert's
MLP, done once for all of them: hvdtrain does the same, with the module's own class and forward
(any experts implementation: eager, batched_mm, grouped_mm) on slices that carry ``tensor_shard``.

Experts stored transposed, (experts, in, out) (Aria, Llama 4), are cut along the same intermediate
dimension: their plans name ``gate_up_proj: packed_rowwise`` (its last dim, [gate | up] columns cut
alike) and ``down_proj: colwise`` (its rows). LongCat-Flash's identity experts inside the split
experts have their input divided by the group size (``moe_identity_expert``), as transformers does.

The router, and a shared expert the plan does not name, stay whole: they see the same replicated
hidden states on every rank, so the top-k, the routing weights and the auxiliary loss are one
process's. A parameter entry is taken only together with its module's ``moe_tp_experts`` entry and
only when it cuts the dimension this split cuts; anything else (another owner, another cut, an
experts layout whose split transformers would not reproduce exactly) is refused by name.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Dict, List, Mapping, Tuple

import torch
from torch import nn

from hvdtrain.parallel.tensor.layers import SumOutput, TensorShard, _shard, copy_to_tensor_group, own_copy

EXPERT_STYLES = ("moe_tp_experts",)
# How transformers cuts a 3-D parameter named by its own plan entry (shard_param: colwise Shard(ndim - 2),
# rowwise Shard(-1), packed_colwise a strided shard of ndim - 2 in 2 groups, packed_rowwise a strided
# shard of the last dim in 2 groups: a transposed layout's [gate | up] columns).
PARAMETER_CUTS = {"colwise": (1, 1), "packed_colwise": (1, 2), "rowwise": (2, 1), "packed_rowwise": (2, 2)}
# transformers' styles hvdtrain does not reproduce, and why (named when a plan uses one).
NOT_REPRODUCED = {
    "embedding_colwise": "an embedding split by its hidden dimension is not implemented",
    "sequence_parallel": "sequence parallelism is not implemented",
    "grouped_gemm": "transformers' expert-parallel plan (base_model_ep_plan) is not read: use train.expert_parallel",
    "ep_dispatch_experts": "transformers' expert-parallel plan (base_model_ep_plan) is not read: use train.expert_parallel",
}


def why_not(style: str) -> str:
    """The reason hvdtrain refuses transformers' ``style``, or "" for a style it does not know."""
    reason = NOT_REPRODUCED.get(style)
    return f" ({style}: {reason})" if reason else ""


def parameter_paths(model: nn.Module, key: str) -> List[str]:
    """The parameter paths a plan ``key`` names (transformers' plans name fused experts' parameters
    themselves: ``layers.*.mlp.experts.gate_up_proj``), under the base model's prefix too."""
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    matched = [name for name in names if name == key or fnmatch.fnmatchcase(name, key)]
    prefix = getattr(model, "base_model_prefix", None)
    if not matched and isinstance(prefix, str) and prefix and hasattr(model, prefix):
        matched = [name for name in names if fnmatch.fnmatchcase(name, f"{prefix}.{key}")]
    return matched


def _projections(module: nn.Module, transposed: bool = False) -> Dict[str, Tuple[int, int]]:
    """The fused experts' 3-D parameters and the cut each needs, (dim, packed groups), so that rank i
    holds intermediate slice i of every expert in both ([gate; up] cut alike when gated). Laid out
    (experts, out, in): the input projection by its output rows, ``down_proj`` by its input columns.
    Transposed, (experts, in, out) (Aria, Llama 4): the input projection by its last dim (transformers'
    packed_rowwise), ``down_proj`` by its rows (its colwise)."""
    gated = getattr(module, "has_gate", True)
    groups = 2 if gated else 1
    input_dim, down_dim = (2, 1) if transposed else (1, 2)
    return {"gate_up_proj" if gated else "up_proj": (input_dim, groups), "down_proj": (down_dim, 1)}


def named_cuts(model: nn.Module, entries: Mapping[str, str]) -> Dict[str, str]:
    """Parameter path -> style, for the plan ``entries`` (key -> style) that name parameters."""
    return {parameter: style for key, style in entries.items() for parameter in parameter_paths(model, key)}


def is_transposed(path: str, module: nn.Module, cuts: Mapping[str, str]) -> bool:
    """Whether the experts at ``path`` hold (experts, in, out) weights: as the module declares
    (transformers' ``is_transposed``); a module declaring nothing (Llama 4's) as its plan cuts
    ``down_proj`` (``cuts``: parameter path -> style): colwise, its rows, is the transposed layout's
    intermediate dim. A plan that misreads the layout then meets check_experts' shape check: either
    misreading compares half the hidden size with the whole."""
    declared = getattr(module, "is_transposed", None)
    if isinstance(declared, bool):
        return declared
    return cuts.get(f"{path}.down_proj") == "colwise"


def check_experts(path: str, module: nn.Module, size: int, transposed: bool = False) -> None:
    """ValueError naming ``path`` when ``moe_tp_experts`` cannot split ``module`` over the ranks exactly
    as transformers does.

    Args:
        path: the module's path in the model.
        module: the experts module.
        size: ranks in the tensor group.
        transposed: its layout, transformers' is_transposed.
    """
    name = type(module).__name__
    for flag, reason in (("has_bias", "has biases, which a sum over the group would count once per rank"),
                         ("has_post_expert_norm", "normalizes each expert's output, which a split leaves partial")):
        if getattr(module, flag, False):
            raise ValueError(f"tensor plan: {path} ({name}, moe_tp_experts) {reason}: hvdtrain splits fused "
                             f"experts [gate; up] x down without biases or norms. Leave it and its parameters out "
                             f"of the plan (the experts stay whole) or use train.tensor_parallel=1")
    if getattr(module, "has_gate", True) and not getattr(module, "is_concatenated", True):
        raise ValueError(f"tensor plan: {path} ({name}) interleaves gate and up rows, which transformers' "
                         f"packed_colwise does not cut as pairs: leave the experts out of the plan")
    projections = _projections(module, transposed)
    own = dict(module.named_parameters(recurse=False))
    if any(isinstance(child, nn.Module) and any(True for _ in child.parameters()) for child in module.children()):
        raise ValueError(f"tensor plan: {path} ({name}) holds experts as submodules with parameters, not fused "
                         f"3-D parameters: give each expert's linears colwise/rowwise entries instead of "
                         f"moe_tp_experts")
    missing = [p for p in projections if not isinstance(own.get(p), torch.Tensor) or own[p].dim() != 3]
    extra = sorted(set(own) - set(projections))
    if missing or extra:
        what = f"has no 3-D {', '.join(missing)}" if missing else f"has parameters besides them ({', '.join(extra)})"
        layout = "(experts, in, out)" if transposed else "(experts, out, in)"
        raise ValueError(f"tensor plan: {path} ({name}, moe_tp_experts) {what}: hvdtrain splits fused experts "
                         f"holding exactly {' and '.join(projections)} {layout}")
    if any(hasattr(p, "tensor_shard") for p in own.values()):
        raise ValueError(f"tensor plan: {path} is already split: parallelize once")
    intermediate = {p: own[p].shape[dim] // groups for p, (dim, groups) in projections.items()}
    if len(set(intermediate.values())) != 1:
        layout = "transposed, (experts, in, out)" if transposed else "(experts, out, in)"
        raise ValueError(f"tensor plan: {path} ({name}): the projections' intermediate sizes differ "
                         f"({intermediate}) read as {layout}: not a fused [gate; up] x down layout, or the plan's "
                         f"entries cut another layout than the experts hold")
    width = next(iter(intermediate.values()))
    if width % size:
        raise ValueError(f"tensor plan: {path} ({name}) has an expert intermediate size of {width}, not divisible "
                         f"by tensor_parallel={size}")


def check_parameter_entries(model: nn.Module, entries: Mapping[str, str], chosen: Mapping[str, str]) -> None:
    """Every plan entry naming parameters (``entries``: key -> style) must cut a parameter of an
    experts module the plan splits by ``moe_tp_experts`` (``chosen``: module path -> style) as that
    split cuts it, and every such module's parameters must be named: otherwise the plan and the
    split would disagree. ValueError naming the entry or the module."""
    named: Dict[str, str] = {}
    cuts = named_cuts(model, entries)
    layout = lambda path: _projections(model.get_submodule(path), is_transposed(path, model.get_submodule(path), cuts))
    for key, style in entries.items():
        for parameter in parameter_paths(model, key):
            owner, _, attribute = parameter.rpartition(".")
            owner_style = chosen.get(owner)
            if owner_style not in EXPERT_STYLES:
                raise ValueError(f"tensor plan: {key!r} ({style}) names the parameter {parameter}, and its module "
                                 f"{owner or type(model).__name__} is {'given ' + repr(owner_style) if owner_style else 'not in the plan'}: "
                                 f"hvdtrain splits a bare parameter only inside experts split by moe_tp_experts "
                                 f"(how another module's forward uses a slice is unknown). Leave {key!r} out")
            cut = layout(owner).get(attribute)
            if cut is None or PARAMETER_CUTS.get(style) != cut:
                raise ValueError(f"tensor plan: {key!r} cuts {parameter} as {style!r}, but moe_tp_experts cuts "
                                 f"{attribute} {_describe(cut)}: the plan and the split disagree; give "
                                 f"{_style_for(cut)!r} or leave the experts out of the plan")
            named[parameter] = style
    for path, style in chosen.items():
        if style in EXPERT_STYLES:
            unnamed = [f"{path}.{p}" for p in layout(path) if f"{path}.{p}" not in named]
            if unnamed:
                raise ValueError(f"tensor plan: {path} is split by moe_tp_experts, but no entry names "
                                 f"{', '.join(unnamed)}: give each its own entry ({_plan_hint(path, layout(path))})")


def _describe(cut: Any) -> str:
    if cut is None:
        return "not at all (it is not one of its projections)"
    dim, groups = cut
    return f"along dim {dim}" + (f" in {groups} packed groups" if groups > 1 else "")


def _style_for(cut: Any) -> str:
    return next((style for style, c in PARAMETER_CUTS.items() if c == cut), "none")


def _plan_hint(path: str, projections: Mapping[str, Tuple[int, int]]) -> str:
    return ", ".join(f"{path}.{p}: {_style_for(cut)}" for p, cut in projections.items())


def split_experts(module: nn.Module, group: Any, path: str, transposed: bool = False) -> nn.Module:
    """A copy of the experts ``module`` (its class, its forward) holding this rank's intermediate
    slice of every expert, its inputs' gradients summed over the group in backward (f) and its
    output summed over the group in forward (g). The module as built is left as it was (a model
    built on the meta device initializes it whole, then keeps the slices).

    Args:
        module: the experts module.
        group: the tensor group.
        path: its path in the model, naming its collectives.
        transposed: its layout, transformers' is_transposed.
    """
    split = own_copy(module)
    for attribute, (dim, groups) in _projections(module, transposed).items():
        shard = TensorShard(dim=dim, parts=group.size, index=group.index, groups=groups)
        split._parameters[attribute] = _shard(module._parameters[attribute], shard)
    split.register_forward_pre_hook(_SumInputGradients(group, path), with_kwargs=True)
    split.register_forward_hook(SumOutput(group, path))
    return split


class _SumInputGradients:
    """f on the experts' differentiable inputs: each rank's slice of every expert gives a part of
    their gradients (the hidden states' and the routing weights'), summed over the group."""

    def __init__(self, group: Any, name: str) -> None:
        self.group, self.name = group, name

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> Tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for position, input_name in ((0, "hidden_states"), (2, "top_k_weights")):
            if position < len(args):
                args[position] = self._f(args[position], input_name)
            elif input_name in kwargs:
                kwargs[input_name] = self._f(kwargs[input_name], input_name)
        return tuple(args), kwargs

    def _f(self, x: Any, input_name: str) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        return copy_to_tensor_group(x, self.group, f"tp.f.{self.name}.{input_name}")


# --- transformers' moe_identity_expert (LongCat-Flash's zero-computation experts) ---------------
# An identity expert inside split experts runs on every rank whole, and the experts' output is
# summed over the group: it would count T times. transformers divides its input by the group size
# (MoeIdentityParallel), so the sum gives it once; and backward, each rank's part of its inputs'
# gradient is 1/T of the whole, which the experts' input sum (f) adds back up.
IDENTITY_STYLES = ("moe_identity_expert",)


def check_identity_expert(path: str, module: nn.Module, owner_path: str, owner_style: Any) -> None:
    """ValueError naming ``path`` when ``moe_identity_expert`` cannot apply to ``module``: a module
    without parameters (what it computes must be linear in its input, as an identity is: the
    probe proves it) directly inside experts split by moe_tp_experts, whose output sum undoes the
    division; anywhere else the division would stay.

    Args:
        path: the module's path in the model.
        module: the identity expert.
        owner_path: the path of the experts module it sits in.
        owner_style: the plan's style for that module (moe_tp_experts is needed).
    """
    if owner_style not in EXPERT_STYLES:
        owner = f"{owner_path} is {'given ' + repr(owner_style) if owner_style else 'not in the plan'}"
        raise ValueError(f"tensor plan: {path} (moe_identity_expert) divides its input by the group size for the sum "
                         f"of the experts that hold it, but its owner {owner}: give the owner moe_tp_experts or "
                         f"leave {path} out of the plan")
    if any(True for _ in module.parameters()):
        raise ValueError(f"tensor plan: {path} ({type(module).__name__}, moe_identity_expert) has parameters: "
                         f"hvdtrain divides the input of a parameterless (identity) expert only")
    if getattr(module, "_tp_identity_divided", False):
        raise ValueError(f"tensor plan: {path} already divides its input: parallelize once")


def divided_identity(module: nn.Module, group: Any) -> nn.Module:
    """A copy of the identity expert ``module`` whose input is divided by ``group``'s size (the
    module as built is left as it was: the whole model's)."""
    divided = own_copy(module)
    size = group.size

    def divide(_module: nn.Module, args: tuple) -> tuple:
        if not args or not isinstance(args[0], torch.Tensor):
            raise TypeError(f"{type(module).__name__} (moe_identity_expert) takes a tensor first: nothing to divide")
        return (args[0] / size,) + tuple(args[1:])

    divided.register_forward_pre_hook(divide)
    divided._tp_identity_divided = True
    return divided

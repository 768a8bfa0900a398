"""transformers' ``local_params``: a module whose forward runs on its own split bare parameters.

An attention's per-head vector that is a bare ``nn.Parameter`` (attention sinks, ``sinks``; a
per-head gate's bias, ``gate_bias``) has no forward to hook. transformers' plans cut it by its own
entry (``layers.*.self_attn.sinks: colwise``: one value per head, cut by heads like q_proj's rows)
and mark its owner ``local_params``, so the owner's forward sees this rank's slice. hvdtrain's split
parameters are plain local tensors already, so the owner needs nothing more; the entry's parameter
becomes this rank's slice along dim 0, recorded (``tensor_shard``) so checkpoints gather it whole.

Only 1-D per-head vectors are cut here (every such entry transformers ships): how a forward uses a
slice of a larger bare parameter is unknown, so one is refused by name. Whether the owner's forward
really takes the slice as this rank's heads is proven as for every split: the set-up probe compares
the logits with the whole model's, and the first step's audit the gradients.
"""
from __future__ import annotations

from typing import Any, List, Mapping

from torch import nn

from hvdtrain.parallel.tensor.layers import _shard, is_placeholder
from hvdtrain.parallel.tensor.shard import TensorShard

LOCAL_STYLES = ("local_params",)
# How a plan entry cuts a 1-D bare parameter: colwise cuts a layer's outputs, and a per-head vector
# is indexed by them (transformers' ColwiseParallel shards a 1-D parameter along its only dim).
VECTOR_CUTS = ("colwise",)


def check_local_parameter(key: str, parameter_path: str, parameter: nn.Parameter, style: str, size: int) -> None:
    """ValueError naming the entry when ``style`` cannot cut ``parameter`` of a ``local_params`` owner.

    Args:
        key: the plan's entry.
        parameter_path: the parameter's path in the model.
        parameter: the bare parameter.
        style: the entry's style.
        size: ranks in the tensor group.
    """
    if style not in VECTOR_CUTS:
        raise ValueError(f"tensor plan: {key!r} cuts the bare parameter {parameter_path} as {style!r}; inside a "
                         f"local_params module hvdtrain cuts per-head vectors by {', '.join(VECTOR_CUTS)} only: "
                         f"leave {key!r} and its owner out of the plan")
    if parameter.dim() != 1:
        raise ValueError(f"tensor plan: {key!r} names {parameter_path} of shape {tuple(parameter.shape)}: hvdtrain "
                         f"cuts only 1-D per-head vectors of a local_params module (how its forward uses a slice "
                         f"of more is unknown); leave {key!r} and its owner out of the plan")
    if parameter.shape[0] % size:
        raise ValueError(f"tensor plan: {parameter_path} ({style}) has {parameter.shape[0]} entries, not divisible "
                         f"by tensor_parallel={size}")
    if is_placeholder(parameter) or parameter.is_meta:
        raise ValueError(f"tensor plan: {parameter_path} is not initialized yet (built on the meta device): a bare "
                         f"parameter of a local_params module is cut from its values; build the model on a real "
                         f"device or leave {key!r} and its owner out of the plan")
    if hasattr(parameter, "tensor_shard"):
        raise ValueError(f"tensor plan: {parameter_path} is already split: parallelize once")


def owned_parameters(path: str, named: Mapping[str, str]) -> List[str]:
    """The attributes of ``path``'s bare parameters among ``named`` (parameter path -> style)."""
    return [parameter.rpartition(".")[2] for parameter in named if parameter.rpartition(".")[0] == path]


def split_local_parameters(module: nn.Module, attributes: List[str], group: Any) -> None:
    """Replace each of ``module``'s ``attributes`` by this rank's slice along dim 0 (rank i holds the
    values of the i-th block of heads, as a colwise projection holds their rows)."""
    for attribute in attributes:
        whole = module._parameters[attribute]
        module._parameters[attribute] = _shard(whole, TensorShard(dim=0, parts=group.size, index=group.index))

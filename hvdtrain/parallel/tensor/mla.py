"""transformers' ``mla_kv_a_proj``: multi-head latent attention's shared key/value projection.

DeepSeek-V2-style attention (deepseek_v2, minicpm3, glm4_moe_lite, longcat_flash, hy_v4) projects the
hidden states once, whole on every rank, into [latent (kv_lora_rank); k_rot (qk_rope_head_dim)]:

    kv_a_proj_with_mqa -> split -> latent -> kv_a_layernorm -> kv_b_proj (colwise) -> k_pass, v
                               \\-> k_rot (one rotary key shared by every head) -----> k_rot

The latent reaches this rank's heads through kv_b_proj, whose split already sums its input's
gradient over the tensor group. k_rot goes to this rank's heads directly: each rank's gradient of
it is only its heads' part. transformers (MlaKvAProjParallel) sums that part's gradient over the
group and leaves the forward as it is; so does this, with a forward hook, so the projection keeps
its parameters and their names (the checkpoint is the one process's). Whether the sum is right is
still proven on the first step (hvdtrain.parallel.tensor.audit: the projection's weight gradient
must then agree on every rank).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from hvdtrain.parallel.tensor.layers import copy_to_tensor_group

MLA_STYLES = ("mla_kv_a_proj",)


def rope_width(model: nn.Module, parent: Optional[nn.Module]) -> Optional[int]:
    """The rotary key's width at the end of the projection's output: the attention's own
    ``qk_rope_head_dim``, else its configuration's (where transformers reads it), else None."""
    width = getattr(parent, "qk_rope_head_dim", None)
    if not isinstance(width, int):
        config = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        width = getattr(text, "qk_rope_head_dim", None)
    return width if isinstance(width, int) else None


def check_mla(path: str, module: nn.Module, model: nn.Module, parent: Optional[nn.Module]) -> None:
    """ValueError naming ``path`` when ``mla_kv_a_proj`` cannot apply to ``module``.

    Args:
        path: the module's path in the model.
        module: the projection (kv_a_proj_with_mqa).
        model: the whole model, whose config may give qk_rope_head_dim.
        parent: the attention holding the projection, or None.
    """
    if not isinstance(module, nn.Linear):
        raise ValueError(f"tensor plan: {path} is {type(module).__name__}, but style 'mla_kv_a_proj' applies to the "
                         f"nn.Linear projecting [latent; rotary key] (kv_a_proj_with_mqa)")
    width = rope_width(model, parent)
    if width is None:
        raise ValueError(f"tensor plan: {path} (mla_kv_a_proj): neither its attention nor the model's config has an "
                         f"int qk_rope_head_dim, the rotary key's width the style needs; set it in the config or "
                         f"leave {path} out of the plan")
    if getattr(module, "_tp_mla_summed", False):
        raise ValueError(f"tensor plan: {path} already sums its rotary key's gradient: parallelize once")
    if not 0 < width < module.out_features:
        raise ValueError(f"tensor plan: {path} (mla_kv_a_proj) has out_features={module.out_features}, which does "
                         f"not hold a latent and a rotary key of qk_rope_head_dim={width}")


def sum_rotary_key_gradient(module: nn.Module, model: nn.Module, parent: Optional[nn.Module], group: Any,
                            path: str) -> None:
    """Keep ``module`` whole; sum its rotary key's gradient over ``group`` (each rank's heads give a part).

    Args:
        module: the projection (kv_a_proj_with_mqa).
        model: the whole model, whose config may give qk_rope_head_dim.
        parent: the attention holding the projection, or None.
        group: the tensor group.
        path: the module's path, naming the collective.
    """
    width = rope_width(model, parent)
    name = f"tp.mla.{path}"

    def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> torch.Tensor:
        latent, rotary = output.split([output.shape[-1] - width, width], dim=-1)
        return torch.cat([latent, copy_to_tensor_group(rotary, group, name)], dim=-1)

    module.register_forward_hook(hook)
    module._tp_mla_summed = True

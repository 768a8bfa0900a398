"""The few families the generic shrinking of hvdtrain.verify.tiny cannot reach, each with why.

Two kinds, each keyed by model type: a value the family's config class has no default for (real
checkpoints ship one), filled in before the layer lists are cut to the tiny depth; and a mend that
takes the config's values once they are shrunk (a dict, as from_dict reads it) and gives what the
family's own class needs that no rule keyed on attribute names could give.
"""
from __future__ import annotations

from typing import Any, Callable, Dict

# Values a config class has no default for, given the shape of a released checkpoint's, cut to the
# tiny depth.
MISSING_DEFAULTS: Dict[str, Dict[str, Any]] = {
    # Lfm2MoeConfig.layer_types defaults to None and its model indexes it (LFM2-8B-A1B alternates
    # short convolutions and attention): one of each.
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
}

# The attention sizes dots3's class reads from swa_* arguments for its sliding layers.
DOTS3_SLIDING_SIZES = ("num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                       "v_head_dim")


def _dots3_note_text(values: Dict[str, Any]) -> None:
    """dots3's sliding layers take their attention sizes from per_layer_config: absolute full-size
    overrides (64 heads, kv_lora_rank 1024, qk_nope_head_dim 192) keyed by layer index, which its
    class derives from swa_* arguments when they are absent. Its validator also wants as many
    key/value heads as query heads, and a sliding layer's head_dim equal to qk_nope + qk_rope
    (the latent-attention rule that makes head_dim the rotary part breaks that). So the overrides
    are left for the class to derive from tiny swa_* sizes, the same as the other layers'."""
    values.pop("per_layer_config", None)
    values["num_key_value_heads"] = values["num_attention_heads"]
    values["head_dim"] = values["qk_nope_head_dim"] + values["qk_rope_head_dim"]
    for name in DOTS3_SLIDING_SIZES:
        values[f"swa_{name}"] = values[name]
    values["swa_num_key_value_heads"] = values["num_attention_heads"]
    values["swa_head_dim"] = values["head_dim"]


MENDS: Dict[str, Callable[[Dict[str, Any]], None]] = {
    "dots3_note_text": _dots3_note_text,
}


def fill_missing_defaults(values: Dict[str, Any]) -> None:
    """The family's values its config class leaves None, where MISSING_DEFAULTS has one."""
    for name, value in MISSING_DEFAULTS.get(values.get("model_type"), {}).items():
        if values.get(name) is None:
            values[name] = value


def mend(values: Dict[str, Any]) -> None:
    """Apply the family's mend, if it has one, to its shrunk config values."""
    family_mend = MENDS.get(values.get("model_type"))
    if family_mend is not None:
        family_mend(values)

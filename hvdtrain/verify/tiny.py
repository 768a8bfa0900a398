"""Any Hugging Face decoder family built tiny from its config class alone, in float64 on the CPU.

The installed transformers lists its causal-LM model types (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``);
each has a config class whose defaults describe a full-size model. The sizes below replace those
defaults wherever the config class has the attribute (hidden 64, 2 layers, 4 heads, 2 key/value
heads, vocabulary 128, 4 experts top-2, dropout 0), so a family's own structure (its norms, its
attention, its plans) is kept and only its size shrinks. A family that cannot be built so (one
that is multimodal or an encoder-decoder, one that needs a package or a size this shrinking does
not give) comes back with the reason, not built.
"""
from __future__ import annotations

import contextlib
import dataclasses
import re
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from hvdtrain.strategies.deferred_init import default_dtype
from hvdtrain.verify import tiny_families
from hvdtrain.verify.exact import float64_throughout

LAYERS, HIDDEN, HEADS, KV_HEADS, VOCAB = 2, 64, 4, 2, 128
HEAD_DIM = HIDDEN // HEADS
SEQUENCE = 8  # the token sequences trained on; every position limit is set well above it
POSITIONS = 64

# Attribute -> tiny value, set wherever a family's config has the attribute (by any of its names:
# transformers' attribute_map makes hidden_size reach GPT-2's n_embd). Every kind of size a
# family has, grouped by what it sizes.
SIZES: Dict[str, Any] = {
    # width
    "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "embedding_size": HIDDEN, "emb_dim": HIDDEN,
    "word_embed_proj_dim": HIDDEN, "input_embedding_size": HIDDEN, "output_embedding_size": HIDDEN,
    "attention_hidden_size": HIDDEN, "lru_width": HIDDEN, "embedding_dim": HIDDEN,
    # depth
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS, "num_layers": LAYERS,
    "decoder_layers": LAYERS, "num_decoder_layers": LAYERS,
    # attention
    "num_attention_heads": HEADS, "n_head": HEADS, "n_heads": HEADS, "num_heads": HEADS,
    "decoder_attention_heads": HEADS, "num_decoder_attention_heads": HEADS, "attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS, "num_kv_heads": KV_HEADS, "num_query_groups": KV_HEADS,
    "head_dim": HEAD_DIM, "attention_head_dim": HEAD_DIM, "attention_head_size": HEAD_DIM, "kv_channels": HEAD_DIM,
    "swa_num_attention_heads": HEADS, "swa_num_key_value_heads": KV_HEADS, "swa_head_dim": HEAD_DIM,
    "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": HEAD_DIM, "qk_head_dim": 16,
    "q_lora_rank": 32, "kv_lora_rank": 16,
    "index_n_heads": HEADS, "index_head_dim": HEAD_DIM, "index_topk": SEQUENCE,
    # a sparse-attention indexer over blocks of keys (Qwen4-Exp's QSA): one key head, as it requires;
    # a budget of half the sequence in blocks of 2, so the selection leaves tokens out
    "indexer_n_heads": HEADS, "indexer_kv_heads": 1, "indexer_head_dim": HEAD_DIM,
    "indexer_budget": SEQUENCE // 2, "indexer_compress_ratio": 2,
    "hc_lowrank": 32,  # hyper-connections' low-rank input mixer
    "linear_num_key_heads": KV_HEADS, "linear_num_value_heads": HEADS, "linear_key_head_dim": HEAD_DIM,
    "linear_value_head_dim": HEAD_DIM, "linear_num_heads": HEADS, "linear_head_dim": HEAD_DIM,
    "rotary_dim": HEAD_DIM, "hidden_size_per_layer_input": HEAD_DIM,
    # feed-forward
    "intermediate_size": 2 * HIDDEN, "n_inner": 2 * HIDDEN, "ffn_dim": 2 * HIDDEN, "decoder_ffn_dim": 2 * HIDDEN,
    "ffn_hidden_size": 2 * HIDDEN, "d_inner": 2 * HIDDEN, "dff": 2 * HIDDEN, "dim_ff": 2 * HIDDEN,
    "feed_forward_size": 2 * HIDDEN, "intermediate_size_mlp": 2 * HIDDEN, "dense_intermediate_size": 2 * HIDDEN,
    "prefix_dense_intermediate_size": 2 * HIDDEN,
    # mixture of experts: 4 experts, 2 chosen per token, a small expert
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2, "top_k_experts": 2,
    "moe_intermediate_size": 32, "expert_ffn_hidden_size": 32, "shared_expert_intermediate_size": 32,
    "shared_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "moe_shared_expert_intermediate_size": 32,
    "n_group": 1, "topk_group": 1, "num_expert_group": 1,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    # the vocabulary and positions
    "vocab_size": VOCAB, "max_position_embeddings": POSITIONS, "n_positions": POSITIONS, "n_ctx": POSITIONS,
    "max_sequence_length": POSITIONS, "seq_length": POSITIONS, "max_target_positions": POSITIONS,
    "vocab_size_per_layer_input": VOCAB, "decoder_vocab_size": VOCAB, "pronunciation_vocab_size": VOCAB,
    "shape_vocab_size": VOCAB, "model_max_length": POSITIONS, "context_length": POSITIONS, "max_seq_len": POSITIONS,
    "unpadded_vocab_size": VOCAB,  # Inkling2's head: the vocabulary before padding
    # state-space and recurrent mixers
    "mamba_d_state": 8, "state_size": 8, "ssm_state_size": 8, "mamba_n_heads": HEADS, "mamba_num_heads": HEADS,
    "mamba_d_head": HEAD_DIM, "mamba_head_dim": HEAD_DIM, "mamba_headdim": HEAD_DIM, "mamba_d_ssm": HIDDEN, "mamba_n_groups": 1,
    "mamba_ngroups": 1, "n_groups": 1, "expand": 1, "mamba_expand": 1, "mamba_chunk_size": SEQUENCE, "chunk_size": SEQUENCE,
    # speculative extra layers trained beside the model: none
    "num_nextn_predict_layers": 0, "num_mtp_layers": 0,
    # a BertForCausalLM-style model is causal only when told it is a decoder
    "is_decoder": True,
}
# A dense prefix of this many layers before the experts: cut so that at least one layer has experts.
DENSE_PREFIXES = ("first_k_dense_replace", "num_dense_layers", "first_k_dense")
# Per-layer sizes (one entry a layer) named after the size they override: each entry made that tiny size.
PER_LAYER_SUFFIX = "_per_layer"
# Dropouts and layer drops by name: every float among them is set to 0 (the comparison is exact).
DROPOUT_WORDS = ("dropout", "pdrop", "layerdrop", "jitter")
# A string is a per-layer pattern (one character per layer) only under such a name.
PATTERN_WORDS = ("pattern", "layer", "block", "type")
# Token ids must lie inside the tiny vocabulary (an out-of-range padding_idx is an error).
TOKEN_ID_SUFFIX = "_token_id"
# Counts of layers by name (the depth among them, and counts of some of its layers).
LAYER_COUNT = re.compile(r"^(n|num)_\w*layers$")
# The block a layer_types list names after each attention when it lists a layer as two blocks.
BLOCK_MLP = "mlp"
# transformers' default rotary base (PreTrainedConfig.default_theta).
DEFAULT_ROPE_THETA = 10000.0
# A config holding another model's config is a composite: a vision, audio or text tower beside it.
COMPOSITE = ("vision_config", "audio_config", "text_config", "encoder_config", "decoder_config",
             "patcher_config", "global_config", "vq_config", "depth_decoder_config", "audio_encoder_config")


@dataclasses.dataclass(frozen=True)
class Family:
    """A causal-LM model type of the installed transformers and the plans its config ships."""
    model_type: str
    model_class: str
    tp_plan: bool
    pp_plan: bool

    @property
    def plans(self) -> str:
        return "+".join(name for name, has in (("tp", self.tp_plan), ("pp", self.pp_plan)) if has) or "no plan"


@dataclasses.dataclass
class Tiny:
    """A family built tiny (``model`` float64 on the CPU, from ``config``), or why it could not be
    (``reason``)."""
    family: Family
    config: Any = None
    model: Optional[torch.nn.Module] = None
    reason: Optional[str] = None

    @property
    def built(self) -> bool:
        return self.reason is None


def causal_lm_families() -> List[Family]:
    """Every causal-LM model type of the installed transformers, in its order, with its plans."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    families = []
    for model_type, model_class in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        config_class = CONFIG_MAPPING[model_type]
        families.append(Family(model_type, model_class if isinstance(model_class, str) else model_class[0],
                               bool(getattr(config_class, "base_model_tp_plan", None)),
                               bool(getattr(config_class, "base_model_pp_plan", None))))
    return families


def family(model_type: str) -> Family:
    """The named causal-LM family, or ValueError listing the close names."""
    families = {f.model_type: f for f in causal_lm_families()}
    if model_type not in families:
        import difflib
        close = difflib.get_close_matches(model_type, families, n=5, cutoff=0.5)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ValueError(f"{model_type!r} is not a causal-LM model type of the installed transformers{hint}; "
                         f"give a model type such as llama or gemma2, or a directory with a config.json")
    return families[model_type]


def tiny_config(config: Any) -> Any:
    """A new config of ``config``'s class (a transformers PretrainedConfig) with every size it has
    made tiny, built through the class as a saved config.json is read, so that the values it
    derives (per-layer types, head sizes) follow from the tiny ones and its own checks run."""
    values = config.to_dict()
    _read_blocks_as_layers(values)
    layers_before = _layer_count(values)
    values.update({name: value for name, value in SIZES.items() if name in values})
    if "qk_rope_head_dim" in values and "head_dim" in values:
        # Multi-head latent attention: head_dim is the rotary part's size, not a head's.
        values["head_dim"] = values["qk_rope_head_dim"]
    if "kv_lora_rank" in values and "num_key_value_heads" in values:
        # Multi-head latent attention expands its latent into one key and value per query head; fewer
        # key/value heads would have them repeated again (DeepSeek-V3.2's masked attention fails so).
        values["num_key_value_heads"] = values.get("num_attention_heads", HEADS)
    for name in DENSE_PREFIXES:
        if isinstance(values.get(name), int):
            values[name] = min(values[name], LAYERS - 1)
    tiny_families.fill_missing_defaults(values)
    for name, value in list(values.items()):
        if isinstance(value, float) and any(word in name for word in DROPOUT_WORDS):
            values[name] = 0.0
    _resize_layer_lists(values, layers_before)
    _shrink_per_layer_sizes(values)
    _shrink_layer_counts(values, layers_before)
    _rope_for_every_layer_type(values)
    _keep_token_ids_in_vocabulary(values)
    if isinstance(values.get("sliding_window"), int):
        # A window shorter than the sequence: the family's own sliding masks are exercised.
        values["sliding_window"] = max(SEQUENCE // 2, 2)
    if "use_cache" in values:
        values["use_cache"] = False
    tiny_families.mend(values)
    tiny = type(config).from_dict(values)
    # transformers' grouped expert kernel has no float64; its eager loop over the experts computes
    # the same sums and runs in any dtype.
    tiny._experts_implementation = "eager"
    return tiny


def _layer_count(values: Mapping[str, Any]) -> Optional[int]:
    for name in ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers"):
        if isinstance(values.get(name), int):
            return values[name]
    return None


def _resize_layer_lists(values: Dict[str, Any], layers_before: Optional[int]) -> None:
    """Per-layer lists (layer types, per-layer sizes) cut to the tiny depth, keeping their first
    entries (a family's pattern starts there: sliding then full attention, a dense layer then
    experts); lists of layer indices keep the indices that still exist."""
    if not layers_before or layers_before <= LAYERS:
        return
    for name, value in list(values.items()):
        if isinstance(value, dict) and value and all(str(key).isdigit() for key in value):
            values[name] = {key: v for key, v in value.items() if int(key) < LAYERS}  # per-layer overrides
            continue
        if name in COMPOSITE or not isinstance(value, (list, str)) or not value:
            continue
        if isinstance(value, str) and not any(word in name for word in PATTERN_WORDS):
            continue  # a string that happens to be as long as the model is deep ("gelu", 4 layers)
        if len(value) == layers_before:
            values[name] = _varied_prefix(value)
        elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value) \
                and name.endswith(("layers", "layer_ids", "layer_indices", "_idxs")) and max(value) >= LAYERS:
            values[name] = [v for v in value if v < LAYERS] or [LAYERS - 1]


def _read_blocks_as_layers(values: Dict[str, Any]) -> None:
    """A config that writes each layer as two blocks, its attention then its mlp (dory: layer_types
    alternate a kind of attention with "mlp", every layer count doubled, as its released checkpoints
    store them), and halves them back when read only while "mlp" is listed: read as layers first, or
    the tiny depth given in layers would be halved once more."""
    types = values.get("layer_types")
    if not (isinstance(types, list) and len(types) >= 2 and len(types) % 2 == 0
            and all(kind == BLOCK_MLP for kind in types[1::2]) and BLOCK_MLP not in types[::2]):
        return
    values["layer_types"] = types[::2]
    for name, value in list(values.items()):
        if LAYER_COUNT.match(name) and isinstance(value, int) and not isinstance(value, bool):
            values[name] = value // 2


def _shrink_layer_counts(values: Dict[str, Any], layers_before: Optional[int]) -> None:
    """Counts of layers other than the depth, made to fit the tiny depth. Counts that together are
    the whole depth (dory's input, recurrent and output sections) share the tiny depth, the largest
    sections first; a count that is a part of it (gemma3n's last layers sharing the key/value cache
    of earlier ones) shrinks in proportion, rounded down, so the layers it needs before it are kept
    (a tiny depth cannot hold a count it could hold before: 2 layers hold no 15 shared ones)."""
    if not layers_before or layers_before <= LAYERS:
        return
    counts = {name: value for name, value in values.items() if LAYER_COUNT.match(name) and name not in SIZES
              and isinstance(value, int) and not isinstance(value, bool) and 0 < value <= layers_before}
    if len(counts) >= 2 and sum(counts.values()) == layers_before:
        largest_first = sorted(counts, key=lambda name: -counts[name])  # stable: ties keep their order
        shares = dict.fromkeys(largest_first, 0)
        for layer in range(LAYERS):
            shares[largest_first[layer % len(largest_first)]] += 1
        values.update(shares)
        return
    for name, value in counts.items():
        if value > LAYERS:
            values[name] = value * LAYERS // layers_before


def _rope_for_every_layer_type(values: Dict[str, Any]) -> None:
    """A config whose rotary parameters are given per layer type but default to none at all
    (cohere_compass_text: its model looks each layer type up, so its own defaults do not build):
    transformers' default rotary embedding for each of its layer types."""
    types = values.get("layer_types")
    if values.get("rope_parameters") == {} and isinstance(types, list) and types \
            and all(isinstance(kind, str) for kind in types):
        theta = values.get("rope_theta") or DEFAULT_ROPE_THETA
        values["rope_parameters"] = {kind: {"rope_type": "default", "rope_theta": theta}
                                     for kind in dict.fromkeys(types)}


def _varied_prefix(value: Any) -> Any:
    """The first LAYERS entries of a per-layer pattern, the last replaced by the first entry that
    differs, if the prefix is all one kind (so both kinds of layer are built and trained)."""
    prefix = list(value[:LAYERS])
    if len(set(map(str, prefix))) == 1:
        other = next((v for v in value if str(v) != str(prefix[0])), None)
        if other is not None:
            prefix[-1] = other
    return "".join(prefix) if isinstance(value, str) else prefix


def _shrink_per_layer_sizes(values: Dict[str, Any]) -> None:
    """A per-layer override of a size (Laguna's num_attention_heads_per_layer) given that size's tiny
    value on every layer: left full-size it would override the tiny size everywhere."""
    for name, value in list(values.items()):
        size = name[:-len(PER_LAYER_SUFFIX)]
        if name.endswith(PER_LAYER_SUFFIX) and size in values and isinstance(value, list) \
                and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            values[name] = [values[size]] * len(value)


def _keep_token_ids_in_vocabulary(values: Dict[str, Any]) -> None:
    vocabulary = values.get("vocab_size", VOCAB)
    for name, value in list(values.items()):
        if not name.endswith(TOKEN_ID_SUFFIX):
            continue
        if isinstance(value, int) and value >= vocabulary:
            values[name] = vocabulary - 1
        elif isinstance(value, list) and any(isinstance(v, int) and v >= vocabulary for v in value):
            values[name] = [min(v, vocabulary - 1) for v in value]


def build_tiny(model_type: str, config: Any = None) -> Tiny:
    """The family's tiny config, checked by building it once and running a forward of token ids;
    or the reason it cannot be built tiny. ``config``: a config to shrink (a local config.json's)
    instead of the family's defaults."""
    found = family(model_type)
    if config is None:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception as error:  # a config class that has no usable defaults
            return Tiny(found, reason=f"its config has no usable defaults: {_first_line(error)}")
    composite = [name for name in COMPOSITE if getattr(config, name, None) is not None]
    if composite:
        return Tiny(found, reason=f"multimodal or composite (its config holds {', '.join(composite)})")
    if getattr(config, "is_encoder_decoder", False) and not found.model_class.endswith("ForCausalLM"):
        return Tiny(found, reason="an encoder-decoder")
    try:
        tiny = tiny_config(config)
        model = make_model(tiny, seed=0)
    except ImportError as error:
        return Tiny(found, reason=f"needs a package not installed: {_first_line(error)}")
    except Exception as error:
        return Tiny(found, reason=f"does not build tiny: {type(error).__name__}: {_first_line(error)}")
    problem = _forward_problem(model, tiny)
    return Tiny(found, reason=problem) if problem else Tiny(found, config=tiny, model=model)


def make_model(config: Any, seed: int, device: Optional[str] = None) -> torch.nn.Module:
    """The causal LM of ``config``, float64, its initialization drawn from ``seed``; on the meta
    device (no values: the Trainer gives them) when ``device="meta"``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with default_dtype(torch.float64), (torch.device(device) if device else contextlib.nullcontext()):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
        # Some families keep a router or a decay in float32 whatever the model's dtype: float64 too,
        # so nothing rounds (on the meta device this changes the dtype the Trainer allocates).
        return model.double()


def _forward_problem(model: torch.nn.Module, config: Any) -> Optional[str]:
    """Why a forward of token ids does not give (batch, sequence, vocabulary) logits, or None."""
    ids = torch.randint(0, config.vocab_size, (2, SEQUENCE), generator=torch.Generator().manual_seed(0))
    try:
        # As the runs compared compute: a family that casts its router's input to float32 (Inkling2)
        # meets float64 weights there only outside this block.
        with torch.no_grad(), float64_throughout():
            logits = model(input_ids=ids).logits
    except Exception as error:
        return f"its forward of token ids fails: {type(error).__name__}: {_first_line(error)}"
    if tuple(logits.shape) != (2, SEQUENCE, config.vocab_size):
        return f"its logits have shape {tuple(logits.shape)}, not (batch, sequence, vocabulary)"
    return None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = text.splitlines()[0]
    if line.endswith(":") and error.__cause__ is not None:
        # a wrapper that names only who refused (a config's validator): what it refused is its cause
        line = f"{line} {type(error.__cause__).__name__}: {_first_line(error.__cause__)}"
    return line[:300]


def config_from_directory(path: str) -> Tuple[str, Any]:
    """(model type, config) of a local Hugging Face model directory's config.json."""
    from pathlib import Path

    from transformers import AutoConfig

    directory = Path(path)
    if not (directory / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: give a Hugging Face model directory, or a model type")
    config = AutoConfig.from_pretrained(directory)
    return config.model_type, config

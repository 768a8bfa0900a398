"""A Hugging Face causal language model (Llama, Qwen2, Qwen3, Mistral) trained on the shipped text
(the standard library's reference documentation, one token per character: hvdtrain.examples.textlm).

The model is built on the meta device from a small config (or a local directory's config.json) and
gets its values from the Trainer: under fsdp no rank ever holds it whole. Tensor parallelism splits it
by its own Hugging Face plan and pipeline parallelism cuts it into stages by itself (no plan to
write). With ``model.pretrained`` it starts from that
directory's weights, each rank reading what it keeps; a directory this example wrote (a run's ``hf/``)
fits its character vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Tuple

import torch
import torch.nn.functional as F

from hvdtrain.common.errors import MissingPath
from hvdtrain.config.checks import check_whole_numbers
from hvdtrain.config.train import TrainConfig
from hvdtrain.examples.textlm import TextLMDataConfig

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# Embedding rows padded to a multiple of this, so that tensor parallelism's vocabulary split divides
# them at T = 1, 2, 4, ..., 64 (the padding rows are never a target).
VOCAB_MULTIPLE = 64


@dataclass
class HFLMModelConfig:
    """The causal LM built from a small config, or ``pretrained``."""

    family: str = field(default="llama", metadata={"help": "the transformers model family", "choices": FAMILIES})
    seq_len: int = field(default=64, metadata={"help": "context, in characters (the length of every window)"})
    hidden: int = field(default=128, metadata={"help": "hidden size"})
    layers: int = field(default=2, metadata={"help": "decoder layers"})
    heads: int = field(default=4, metadata={"help": "attention (query) heads"})
    kv_heads: int = field(default=2, metadata={"help": "key/value heads (grouped-query attention when fewer than heads)"})
    intermediate: int = field(default=256, metadata={"help": "the MLP's hidden size"})
    pretrained: str = field(default="", metadata={"help": "a local Hugging Face model directory to start from (config.json + safetensors, e.g. a run's hf/); its config replaces the sizes above"})

    def __post_init__(self) -> None:
        check_whole_numbers(self, ("seq_len", "hidden", "layers", "heads", "kv_heads", "intermediate"))
        if self.family not in FAMILIES:
            raise ValueError(f"HFLMModelConfig.family must be one of {', '.join(FAMILIES)}, got {self.family!r}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"HFLMModelConfig: heads ({self.heads}) must divide hidden ({self.hidden}) and "
                             f"kv_heads ({self.kv_heads}) must divide heads")


@dataclass
class HFLMJob:
    """train_hf.py's settings: --section.key=value overrides (or a YAML file with --config)."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        epochs=3, batch_size=16, lr=0.001, warmup_epochs=0.2, log_every=50, run_dir="runs"))
    model: HFLMModelConfig = field(default_factory=HFLMModelConfig)
    data: TextLMDataConfig = field(default_factory=TextLMDataConfig)


def transformers_module():
    try:
        import transformers
    except ImportError as error:
        raise ImportError("train_hf.py needs transformers: pip install -e '.[hf]'") from error
    return transformers


def padded_vocab(characters: int) -> int:
    return -(-characters // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def model_config(model: HFLMModelConfig, characters: int) -> Tuple[Any, str]:
    """(the transformers config, where it came from): ``pretrained``'s config.json, checked to hold the
    character vocabulary, or a small one of ``family``."""
    transformers = transformers_module()
    if model.pretrained:
        directory = Path(model.pretrained)
        if not (directory / "config.json").is_file():
            raise MissingPath(f"model.pretrained={directory} has no config.json: give a Hugging Face model "
                                    f"directory (save_pretrained's, or a train_hf.py run's hf/)")
        config = transformers.AutoConfig.from_pretrained(directory)
        if config.vocab_size < characters:
            raise ValueError(f"{directory}'s model has {config.vocab_size} tokens, fewer than the {characters} "
                             f"characters this example tokenizes by: start from a directory a train_hf.py run wrote")
        return config, f"the config of {directory}"
    sizes = dict(vocab_size=padded_vocab(characters), hidden_size=model.hidden, intermediate_size=model.intermediate,
                 num_hidden_layers=model.layers, num_attention_heads=model.heads, num_key_value_heads=model.kv_heads,
                 max_position_embeddings=model.seq_len, tie_word_embeddings=model.family == "llama")
    classes = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}
    if model.family == "mistral":
        sizes["sliding_window"] = None
    return classes[model.family](**sizes), f"a small {model.family} config"


def build_on_meta(config: Any) -> torch.nn.Module:
    """The model without memory: the Trainer gives it its values (from train.seed), or load_pretrained."""
    transformers = transformers_module()
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def causal_lm_loss(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) of each character given the ones before it, from the model's output
    (its ``.logits``) or, on a pipeline's last stage, from the logits themselves."""
    logits = getattr(outputs, "logits", outputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def describe(config: Any) -> str:
    """The sizes a reader compares runs by, on one line."""
    return (f"{config.model_type}: {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads ({config.num_key_value_heads} key/value), vocabulary {config.vocab_size}")

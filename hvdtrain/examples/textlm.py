"""A character-level transformer language model on text that every Python install has.

The corpus is CPython's own reference documentation, stored as plain English text in the standard
library's ``pydoc_data.topics`` (what ``help("if")`` prints): 79 topics, about 465,000 characters
on Python 3.11. No download, and no package beyond torch. Its exact content changes a little with
the Python version, so results are comparable on one Python version.

The last ``val_fraction`` of the text is held out: a split by position, so no held-out character
is ever a training input or target.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hvdtrain.config.checks import check_fraction, check_whole_numbers
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.packing import block_causal_mask
from hvdtrain.parallel.sequence.batches import token_offset
from hvdtrain.planner.model_shape import ModelShape


def load_corpus() -> str:
    """The language reference topics, joined in a fixed (sorted) order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as error:  # stripped "minimal" Python packages may drop it
        raise ImportError(
            "the text example trains on the standard library's pydoc_data.topics, missing from this "
            "Python: install its full standard library (Debian/Ubuntu: libpython3.X-stdlib)"
        ) from error
    return "\n".join(topics[key] for key in sorted(topics))


class CharVocab:
    """One token per distinct character of ``text``, numbered in sorted order."""

    def __init__(self, text: str) -> None:
        self.chars: List[str] = sorted(set(text))
        self._index = {char: i for i, char in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = set(text) - self._index.keys()
        if unknown:
            raise ValueError(f"characters outside the vocabulary: {sorted(unknown)!r}")
        return torch.tensor([self._index[char] for char in text], dtype=torch.int64)

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def split_by_position(ids: torch.Tensor, val_fraction: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(first 1 - val_fraction of the sequence, the rest): disjoint, in order, nothing dropped."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    cut = len(ids) - int(round(len(ids) * val_fraction))
    return ids[:cut], ids[cut:]


class WindowDataset(Dataset):
    """Windows of ``seq_len`` tokens every ``stride`` tokens: (ids[s:s+T], ids[s+1:s+T+1]).

    With ``stride == seq_len`` every token after the first is a target exactly once.
    """

    def __init__(self, ids: torch.Tensor, seq_len: int, stride: int) -> None:
        if seq_len < 1 or stride < 1:
            raise ValueError(f"seq_len and stride must be >= 1, got {seq_len} and {stride}")
        if len(ids) < seq_len + 1:
            raise ValueError(f"{len(ids)} tokens cannot fill one window of {seq_len} + 1")
        self.ids, self.seq_len, self.stride = ids, seq_len, stride

    def __len__(self) -> int:
        return (len(self.ids) - self.seq_len - 1) // self.stride + 1

    def __getitem__(self, index: int) -> Tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} of {len(self)}")
        start = index * self.stride
        window = self.ids[start : start + self.seq_len + 1]
        return window[:-1], window[1:]

    def scored_ids(self) -> torch.Tensor:
        """Every target of every window, in order (the characters a validation pass scores)."""
        return torch.cat([self[i][1] for i in range(len(self))])


def load_text_datasets(
    seq_len: int = 64, stride: int = 64, val_fraction: float = 0.1, text: Optional[str] = None
) -> Tuple[WindowDataset, WindowDataset, CharVocab]:
    """Training windows, one every few characters; held-out windows side by side (each held-out
    character scored once). The vocabulary is the alphabet of the whole text, so no held-out
    character is unknown; nothing else of the held-out part reaches training.

    Args:
        seq_len: characters per window.
        stride: characters between the starts of training windows.
        val_fraction: the share of the text held out, at its end.
        text: the text (None: the bundled language reference).
    """
    text = load_corpus() if text is None else text
    vocab = CharVocab(text)
    train_ids, val_ids = split_by_position(vocab.encode(text), val_fraction)
    return WindowDataset(train_ids, seq_len, stride), WindowDataset(val_ids, seq_len, seq_len), vocab


@dataclass
class TextLMModelConfig:
    """The transformer's size and context."""

    seq_len: int = field(default=64, metadata={"help": "context, in characters (the length of every window)"})
    d_model: int = field(default=128, metadata={"help": "embedding width"})
    layers: int = field(default=2, metadata={"help": "transformer blocks"})
    heads: int = field(default=4, metadata={"help": "attention heads (must divide d_model)"})
    dropout: float = field(default=0.0, metadata={"help": "dropout probability in training"})

    def __post_init__(self) -> None:
        check_whole_numbers(self, ("seq_len", "d_model", "layers", "heads"))
        if self.d_model % self.heads:
            raise ValueError(f"TextLMModelConfig.d_model {self.d_model} must be a multiple of heads {self.heads}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"TextLMModelConfig.dropout must be in [0, 1), got {self.dropout!r}")



def planner_shape(vocab: Optional[int] = None) -> ModelShape:
    """The example's model with its default config as the planner models it (``hvdtrain plan
    --example textlm``); the vocabulary from its corpus unless given."""
    config = TextLMModelConfig()
    vocab = len(set(load_corpus())) if vocab is None else vocab
    return ModelShape(config.layers, config.d_model, config.seq_len, vocab, config.heads)

@dataclass
class TextLMDataConfig:
    """How the text is cut into training and held-out windows."""

    val_fraction: float = field(default=0.1, metadata={"help": "share of the text, at its end, held out for validation"})
    train_stride: int = field(default=64, metadata={"help": "characters between the starts of two training windows"})

    def __post_init__(self) -> None:
        check_fraction(self, "val_fraction")
        check_whole_numbers(self, ("train_stride",))


@dataclass
class TextLMJob:
    """train_lm.py's settings: --section.key=value overrides (or a YAML file with --config)."""

    # Five passes take about a minute on 2 idle cores with 2 workers. The Trainer's warm-up starts
    # at the one-worker rate, so that rate must be safe for Adam from step 0: at 0.006 a fresh
    # model stalls near the unigram loss for hundreds of steps (3.4 bits/char after 3 epochs).
    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        epochs=5, batch_size=16, lr=0.001, warmup_epochs=0.2, log_every=50, run_dir="runs"))
    model: TextLMModelConfig = field(default_factory=TextLMModelConfig)
    data: TextLMDataConfig = field(default_factory=TextLMDataConfig)


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.residual_dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch, length, width = x.shape
        # (B, T, 3C) -> three (B, heads, T, C / heads)
        q, k, v = self.qkv(x).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = self.attend(q, k, v) if mask is None else self.attend(q, k, v, mask)
        return self.residual_dropout(self.proj(y.transpose(1, 2).reshape(batch, length, width)))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Causal attention of (B, heads, T, C / heads) tensors, within each document given a packed
        row's mask: sequence parallelism runs it on whole sequences of part of the heads
        (hvdtrain.parallel.sequence.modules).

        Args:
            q: queries, (B, heads, T, C / heads).
            k: keys, alike.
            v: values, alike.
            mask: a packed row's block-causal mask (None: causal).
        """
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              dropout_p=self.dropout if self.training else 0.0)


class Block(nn.Module):
    """Pre-norm: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.attention = CausalSelfAttention(d_model, heads, dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                 nn.Linear(4 * d_model, d_model), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        # No mask, no argument: a tensor-parallel attention (hvdtrain.parallel.tensor.layers) takes none.
        x = x + (self.attention(self.norm1(x)) if mask is None else self.attention(self.norm1(x), mask))
        return x + self.mlp(self.norm2(x))


class TinyTransformerLM(nn.Module):
    """A GPT-style decoder: token + learned position embeddings, pre-norm causal blocks, and an
    output layer tied to the token embedding. Maps (batch, T) ids to (batch, T, vocab) logits.

    Args:
        vocab_size: tokens in the vocabulary.
        seq_len: the longest sequence, in tokens (position embeddings).
        d_model: the hidden width.
        layers: decoder blocks.
        heads: attention heads per block.
        dropout: dropout probability.
    """

    def __init__(self, vocab_size: int, seq_len: int = 64, d_model: int = 128, layers: int = 2,
                 heads: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.token = nn.Embedding(vocab_size, d_model)
        self.position = nn.Embedding(seq_len, d_model)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(d_model, heads, dropout) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.token.weight  # tied: one matrix reads and writes tokens
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2's initialisation; the projections into the residual stream shrink with depth. A
        method, not inline in __init__, so that a model built on the meta device replays it
        (hvdtrain.strategies.deferred_init)."""
        for name, parameter in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(parameter)
            elif parameter.dim() >= 2:
                deep = name.endswith(("attention.proj.weight", "mlp.2.weight"))
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * len(self.blocks)) if deep else 0.02)

    def forward(self, ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits of ``ids``; with ``position_ids`` (packed rows: hvdtrain.data.packing), positions restart
        at every document and attention stays within it. Under sequence parallelism ``ids`` are this
        rank's part of each sequence, from ``token_offset()`` on."""
        first, length = token_offset(), ids.shape[1]
        if first + length > self.seq_len:
            raise ValueError(f"{first + length} tokens exceed the model's context of {self.seq_len}")
        positions = torch.arange(first, first + length, device=ids.device) if position_ids is None else position_ids
        mask = None if position_ids is None else block_causal_mask(position_ids)
        x = self.dropout(self.token(ids) + self.position(positions))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.norm(x))


def lm_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats) over every token of the batch: (B, T, V) logits, (B, T) ids."""
    return F.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), targets.reshape(-1))


def bits_per_char(loss_nats: float) -> float:
    return loss_nats / math.log(2)


def unigram_bits_per_char(train_ids: torch.Tensor, scored_ids: torch.Tensor, vocab_size: int) -> float:
    """The baseline: bits/char of ``scored_ids`` under the training text's character frequencies
    (add-one smoothed), i.e. a model that ignores all context."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1
    log_probs = torch.log2(counts / counts.sum())
    return float(-log_probs[scored_ids].mean())


@torch.no_grad()
def generate(model: TinyTransformerLM, vocab: CharVocab, prompt: str, n: int,
             temperature: float = 0.8, seed: int = 0) -> str:
    """The characters the model writes after a prompt: sampled from a seeded generator (deterministic, the
    global RNG untouched), or greedy at temperature 0.

    Args:
        model: the trained model.
        vocab: its character vocabulary.
        prompt: the text to continue.
        n: characters to write.
        temperature: the sampling temperature; 0: greedy.
        seed: seeds the sampling generator.
    """
    if not prompt:
        raise ValueError("generate needs a prompt of at least one character")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    ids = vocab.encode(prompt).to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for _ in range(n):
        logits = model(ids[-model.seq_len :].unsqueeze(0))[0, -1]
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator)
        else:
            token = logits.argmax().unsqueeze(0)
        ids = torch.cat([ids, token])
    model.train(was_training)
    return vocab.decode(ids[len(prompt) :].tolist())

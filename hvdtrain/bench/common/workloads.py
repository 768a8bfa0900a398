"""The models and data every throughput variant trains: the same in each, built from a seed.

- ``cnn``: ~1.2M parameters, convolutions on 3x32x32 images; compute dominates a step.
- ``mlp``: ~25M parameters (100 MB of fp32 gradients per step) on 1024 features; the step's
  all-reduce is large next to its compute.
- ``many``: hundreds of tiny parameter tensors (a deep stack of narrow linear layers), for the
  tensor-fusion knob: fusion matters when one step all-reduces many small tensors.
- ``lm``: the example transformer language model (hvdtrain.examples.textlm), 8 blocks of width 512:
  25.4M parameters in 8 equal blocks (fsdp's units) and a tied embedding; a sample is a window of
  64 token ids and its next tokens, so a small batch (2 per worker) already computes as much as
  the mlp's 64.

Data is synthetic, a fixed number of samples per rank made from the seed, so no variant reads a
disk or waits for a download, and each variant runs the same DataLoader over the same tensors.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Dict, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

CLASSES = 10
LM_VOCAB, LM_CONTEXT = 256, 64


def one_thread_per_rank() -> None:
    """Every variant computes on one intra-op thread per rank, so they compare like for like
    (OMP_NUM_THREADS is also set for the job by the driver, before torch starts its pool)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


class SmallCNN(nn.Module):
    """Three 3x3 convolutions and two linear layers: 1.24M parameters, compute-bound."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 32 x 16 x 16
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 64 x 8 x 8
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),                   # 64 x 8 x 8
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 288), nn.ReLU(), nn.Linear(288, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def wide_mlp(features: int = 1024, hidden: int = 4096) -> nn.Module:
    """1024 -> 4096 -> 4096 -> 1024 -> 10: 25.2M parameters in 8 tensors."""
    return nn.Sequential(
        nn.Linear(features, hidden), nn.ReLU(),
        nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, features), nn.ReLU(),
        nn.Linear(features, CLASSES),
    )


def many_tensor_mlp(layers: int = 300, width: int = 32) -> nn.Module:
    """``layers`` narrow linear layers: 2 x layers + 2 parameter tensors of ~4 KB each."""
    blocks = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, CLASSES))


def transformer_lm() -> nn.Module:
    """The example transformer language model: 8 blocks of width 512, 8 heads, 64 tokens of context."""
    from hvdtrain.examples.textlm import TinyTransformerLM

    return TinyTransformerLM(LM_VOCAB, seq_len=LM_CONTEXT, d_model=512, layers=8, heads=8, dropout=0.0)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token: (B, T, V) logits, (B, T) next-token ids."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def classes(samples: int, shape: Tuple[int, ...], generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random inputs of ``shape`` and random labels."""
    return torch.randn((samples, *shape), generator=generator), torch.randint(0, CLASSES, (samples,), generator=generator)


def token_windows(samples: int, generator: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """Random token windows and the same windows shifted by one (the next tokens)."""
    ids = torch.randint(0, LM_VOCAB, (samples, LM_CONTEXT + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


@dataclass(frozen=True)
class Workload:
    name: str
    build: Callable[[], nn.Module]
    data: Callable[[int, torch.Generator], Tuple[torch.Tensor, torch.Tensor]]  # (samples, generator) -> inputs, labels
    description: str
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy
    batch: int = 64  # samples per worker per step, unless a bench is told otherwise


WORKLOADS: Dict[str, Workload] = {
    "cnn": Workload("cnn", SmallCNN, lambda n, g: classes(n, (3, 32, 32), g), "small CNN, compute-bound"),
    "mlp": Workload("mlp", wide_mlp, lambda n, g: classes(n, (1024,), g), "wide MLP, communication-bound"),
    "many": Workload("many", many_tensor_mlp, lambda n, g: classes(n, (64,), g), "many small tensors (fusion knob)"),
    "lm": Workload("lm", transformer_lm, token_windows, "transformer language model, 8 equal blocks",
                   loss=lm_loss, batch=2),
}


def get(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(WORKLOADS)}") from None


def build_model(name: str, seed: int) -> nn.Module:
    """The model, initialised from ``seed`` (every rank and every variant gets the same one)."""
    torch.manual_seed(seed)
    return get(name).build()


def synthetic_dataset(name: str, samples: int, seed: int) -> TensorDataset:
    """``samples`` random inputs of the model's shape with random labels, made from ``seed``."""
    return TensorDataset(*get(name).data(samples, torch.Generator().manual_seed(seed)))


def parameter_count(model: nn.Module) -> Tuple[int, int]:
    """(parameters, parameter tensors)."""
    tensors = [p for p in model.parameters() if p.requires_grad]
    return sum(p.numel() for p in tensors), len(tensors)

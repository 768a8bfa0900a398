"""The 8x8 handwritten digits of UCI (1,797 images, 10 classes), as bundled by scikit-learn.

Real data that every install has (no download), small enough that a data-parallel run on
two CPU cores finishes in seconds.
"""
from __future__ import annotations

from typing import Tuple

import torch
from torch import nn
from torch.utils.data import TensorDataset


def load_digits_datasets(val_fraction: float = 0.2, split_seed: int = 0) -> Tuple[TensorDataset, TensorDataset]:
    """Train and validation sets of (1x8x8 image in [0, 1], label).

    The split is fixed by ``split_seed``, so every rank (and every run) splits identically.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:  # the 'examples' extra
        raise ImportError(
            "the digits example needs scikit-learn: pip install 'hvdtrain[examples]'"
        ) from error
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(round(len(labels) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a pooling and two dense layers: about 0.15M parameters."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, 128),
            nn.ReLU(inplace=True),
            nn.Linear(128, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

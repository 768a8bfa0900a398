"""The 8x8 handwritten digits of UCI (1,797 images, 10 classes), as bundled by scikit-learn.

Real data that every install has (no download), small enough that a data-parallel run on
two CPU cores finishes in seconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Tuple

import torch
from torch import nn
from torch.utils.data import TensorDataset

from hvdtrain.config.checks import check_choices, check_fraction, check_whole_numbers
from hvdtrain.config.train import TrainConfig

if TYPE_CHECKING:
    import numpy as np


def read_digits() -> Tuple["np.ndarray", "np.ndarray"]:
    """The 1,797 digits' 64 pixel values (0-16) and their labels, as sklearn.datasets.load_digits gives them.

    Read from the file scikit-learn bundles, without importing scikit-learn: its import (scipy,
    its whole package) took as long as torch's, seconds of every rank's start-up before the first
    step (`hvdtrain bench startup`). find_spec locates the package without running it.
    """
    import importlib.util

    import numpy as np

    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the digits example needs scikit-learn's bundled digits: pip install 'hvdtrain[examples]'")
    bundled = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    if not bundled.is_file():  # a scikit-learn that keeps them elsewhere: its own reader
        from sklearn.datasets import load_digits

        digits = load_digits()
        return digits.data, digits.target
    table = np.loadtxt(bundled, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def load_digits_datasets(val_fraction: float = 0.2, split_seed: int = 0,
                         dtype: torch.dtype = torch.float32) -> Tuple[TensorDataset, TensorDataset]:
    """Train and validation sets of (1x8x8 image in [0, 1] of ``dtype``, label).

    The split is fixed by ``split_seed``, so every rank (and every run) splits identically.
    """
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    pixels, targets = read_digits()
    images = torch.tensor(pixels, dtype=dtype).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(targets, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(split_seed))
    n_val = int(round(len(labels) * val_fraction))
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


MODEL_DTYPES = ("float32", "float64")


@dataclass
class DigitsModelConfig:
    """The digits CNN's size."""

    channels: int = field(default=32, metadata={"help": "channels of the first convolution (the second has twice as many)"})
    hidden: int = field(default=128, metadata={"help": "units of the hidden dense layer"})
    dtype: str = field(default="float32", metadata={
        "help": "parameter and input precision; float64 makes runs that differ only in summation "
                "order (another worker count, another CPU) agree to ~1e-12 (the tests use it)",
        "choices": MODEL_DTYPES})

    def __post_init__(self) -> None:
        check_whole_numbers(self, ("channels", "hidden"))
        check_choices(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


@dataclass
class DigitsDataConfig:
    """How the 1,797 digits are split."""

    val_fraction: float = field(default=0.2, metadata={"help": "share of the digits held out for validation"})
    split_seed: int = field(default=0, metadata={"help": "seed of the fixed train/validation split"})

    def __post_init__(self) -> None:
        check_fraction(self, "val_fraction")


@dataclass
class DigitsJob:
    """train.py's settings: configs/digits.yaml and --section.key=value overrides."""

    train: TrainConfig = field(default_factory=lambda: TrainConfig(
        epochs=12, batch_size=32, lr=0.02, warmup_epochs=2, log_every=10, run_dir="runs"))
    model: DigitsModelConfig = field(default_factory=DigitsModelConfig)
    data: DigitsDataConfig = field(default_factory=DigitsDataConfig)


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a pooling and two dense layers: about 0.15M parameters by default."""

    def __init__(self, classes: int = 10, channels: int = 32, hidden: int = 128) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(2 * channels * 4 * 4, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

"""Random number generators: one seed per rank, and their states in checkpoint-safe form.

A checkpoint is loaded with ``weights_only``: only tensors and plain values. NumPy's state holds
an ndarray, so it is stored as a tensor and turned back on restore.
"""
from __future__ import annotations

import random
from typing import Any, Dict

import numpy as np
import torch


def rank_seed(seed: int, rank: int) -> int:
    """A seed for one rank, derived from the job's seed: distinct per rank, the same every run."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture() -> Dict[str, Any]:
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: Dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

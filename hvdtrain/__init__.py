"""hvdtrain: data-parallel PyTorch training across many machines, on Horovod and MPI.

    world = hvdtrain.init(seed=42)
    trainer = hvdtrain.Trainer(model, optimizer, train_set, val_set, hvdtrain.TrainConfig())
    history = trainer.fit()

The names below are imported on first use, so that ``import hvdtrain`` (and tools that run on
login nodes, such as the launcher) does not pay for importing torch and Horovod.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "init": "hvdtrain.distributed.startup",
    "World": "hvdtrain.distributed.startup",
    "Trainer": "hvdtrain.trainer",
    "ModelPlan": "hvdtrain.parallel.model_plan",
    "TrainConfig": "hvdtrain.config.train",
    "ShardedSampler": "hvdtrain.data.sharding",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")

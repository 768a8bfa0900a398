"""hvdtrain: data-parallel PyTorch training across many machines, on Horovod and MPI.

    job, args = hvdtrain.parse_job(MyJob, hvdtrain.job_argument_parser(MyJob, __doc__))
    world = hvdtrain.init(job.train)
    trainer = hvdtrain.Trainer(model, optimizer, train_set, val_set, job.train, world=world)
    history = trainer.fit()

or your own loop on the same set-up (hvdtrain.session)::

    hv = hvdtrain.setup(model, optimizer, train_set, job.train)
    for epoch in hv.epochs():
        for inputs, targets in hv.batches():
            hv.backward(F.cross_entropy(hv.model(inputs), targets))
            hv.step()

The names below are the public API; everything else is internal and may change. They are imported
on first use, so that ``import hvdtrain`` (and the tools that run on login nodes) does not pay for
importing torch and Horovod.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # start-up and who this process is
    "init": "hvdtrain.distributed.startup",
    "HvdtrainError": "hvdtrain.common.errors",
    "World": "hvdtrain.distributed.world",
    # settings
    "TrainConfig": "hvdtrain.config.train",
    "parse_job": "hvdtrain.config.loader",
    "job_argument_parser": "hvdtrain.config.loader",
    "load_job": "hvdtrain.config.loader",
    "to_dict": "hvdtrain.config.loader",
    # training: your own loop on a session, or the Trainer's
    "setup": "hvdtrain.session",
    "Session": "hvdtrain.session",
    "Trainer": "hvdtrain.trainer",
    "evaluate_model": "hvdtrain.trainer",
    "ModelPlan": "hvdtrain.parallel.model_plan",
    "meta_parameters": "hvdtrain.strategies.deferred_init",
    "StepFn": "hvdtrain.components.steps",
    "supervised_step": "hvdtrain.components.steps",
    "ShardedSampler": "hvdtrain.data.sharding",
    "StreamShards": "hvdtrain.data.streaming",
    "packed": "hvdtrain.data.packing",
    "packed_lm_step": "hvdtrain.data.packing",
    "Callback": "hvdtrain.components.callbacks",
    "EarlyStopping": "hvdtrain.components.callbacks",
    "EMA": "hvdtrain.components.callbacks",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")

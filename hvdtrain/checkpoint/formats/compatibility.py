"""Whether a checkpoint belongs to this run: the settings it was written with against this run's.

Every checkpoint records the job's resolved configuration. A run resumes it only when the settings
that define the training are the same: every section but ``train`` (the model, the data), and in
``train`` those of TrainConfig.DEFINES_THE_RUN. The others (length, strategy and layout, worker
count, checkpointing, reporting) may change between a run and its resume. ``train.resume=force``
resumes all the same, saying what differs.
"""
from __future__ import annotations

import logging
from typing import Any, List, Mapping

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.common.nested import flatten
from hvdtrain.config.train import TrainConfig

_ABSENT = "(absent)"


def _defines_the_run(key: str) -> bool:
    section, _, name = key.partition(".")
    return section != "train" or name in TrainConfig.DEFINES_THE_RUN


def differing_settings(saved: Mapping[str, Any], current: Mapping[str, Any]) -> List[str]:
    """``key: saved -> current`` for every setting that defines the run and differs."""
    before, after = flatten(saved), flatten(current)
    # A train setting added after the checkpoint was written had its default then (the behaviour
    # that hvdtrain had before the setting existed).
    defaults = TrainConfig()
    for key in after:
        section, _, name = key.partition(".")
        if section == "train" and key not in before and hasattr(defaults, name):
            before[key] = getattr(defaults, name)
    keys = sorted(key for key in set(before) | set(after) if _defines_the_run(key))
    return [f"{key}: {before.get(key, _ABSENT)!r} -> {after.get(key, _ABSENT)!r}"
            for key in keys if before.get(key, _ABSENT) != after.get(key, _ABSENT)]


def check_settings(checkpoint: Mapping[str, Any], job_config: Mapping[str, Any], force: bool,
                   log: logging.Logger) -> None:
    """Refuse to resume a checkpoint whose recorded settings differ from this run's in what defines
    the run (CheckpointError listing them).

    Args:
        checkpoint: the checkpoint resumed: a full one, or a sharded one's manifest.
        job_config: this run's resolved settings, as checkpoints record them.
        force: resume all the same, logging what differs (train.resume=force).
        log: where that warning goes.
    """
    saved = checkpoint.get("config") or {}
    if not saved:  # written before checkpoints recorded their settings: nothing to compare
        return
    differing = differing_settings(saved, job_config)
    if not differing:
        return
    where = checkpoint.get("path") or f"the checkpoint of step {checkpoint.get('step')}"
    listed = "; ".join(differing)
    if force:
        log.warning(f"resuming {where} with other settings than it was written with (train.resume=force): {listed}")
        return
    raise CheckpointError(
        f"{where} was written with other settings than this run's: {listed}. Resuming it would continue another "
        f"run's training with these changed. Give a new run another checkpoint_dir, or set train.resume=force to "
        f"continue this one with the new settings")

"""Checkpoints: what a run saves to continue exactly, on disk and across ranks.

    manager.py        the one door the session and trainer use: the state saved, resume, the save on preemption
    coordination.py   who reads and writes across ranks, and every rank agreeing on failures
    ownership.py      one live run per checkpoint directory: its lease, the owner record
    formats/          what is on disk: the full format (one file), the sharded one (a file per rank and
                      a manifest), the run state both hold, the kept objects, the settings' check
    sources/          a model's tensors asked by name, the same way of every source (contract.py):
                      a full checkpoint, a sharded or mesh one at any layout; a strategy's load_from reads them
    async_writing/    train.checkpoint_async: the state copied to host memory, written by a thread
    consolidate.py    a sharded checkpoint made full, in one process

Weights import and export (safetensors, Hugging Face directories) are hvdtrain.weights.
May import common/, config/, distributed/, parallel/ and strategies/ (a strategy's own state); nothing above.
"""
from __future__ import annotations

from hvdtrain.common.errors import HvdtrainError

FORMAT_VERSION = 1  # of the full format (one file); hvdtrain.checkpoint.formats.sharded has its own


class CheckpointError(HvdtrainError, RuntimeError):
    """A checkpoint that cannot be used; the message says which file and why."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint whose files are not as written: a checksum or size that differs from its record,
    a listed file missing, a file or manifest that cannot be read. A resume sets it aside (renamed,
    never deleted) and falls back to the previous one."""

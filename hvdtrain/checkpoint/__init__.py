"""Checkpoints: what a run saves to continue exactly, on disk and across ranks.

    run_state.py       RunState: where a run is and what it was (one definition, both formats)
    store.py           a checkpoint directory: the full format (one file), listing, ``latest``, pruning
    sharded_format.py  the sharded format: one file per rank and a manifest, published as a directory
    ownership.py       one live run per checkpoint directory: its lock and owner record
    compatibility.py   whether a checkpoint's settings are this run's
    protocol.py        who reads and writes across ranks, and every rank agreeing on failures
    resharding.py      a sharded checkpoint read at another worker count or under another strategy
    manager.py         the Trainer's part: the state it saves, resume, the save on preemption
    consolidate.py     a sharded checkpoint made full, in one process
    export.py          the trained model as safetensors, loadable without hvdtrain
    hf_export.py       a Hugging Face model as a directory from_pretrained loads, streamed from the ranks
    pretrained.py      a Hugging Face weights directory read by slice, each rank only what it keeps

May import common/, config/, distributed/ and strategies/ (a strategy's own state); nothing above.
"""
from __future__ import annotations

FORMAT_VERSION = 1  # of the full format (one file); hvdtrain.checkpoint.sharded_format has its own


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which file and why."""

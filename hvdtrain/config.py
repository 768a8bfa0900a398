"""Typed training settings, validated when created, and their command-line form."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any, Dict, Optional


@dataclass
class TrainConfig:
    """What the Trainer needs to know. Every field is also a command-line flag (--batch-size ...)."""

    epochs: int = field(default=10, metadata={"help": "passes over the training set"})
    batch_size: int = field(default=32, metadata={"help": "samples per worker per micro-batch"})
    lr: float = field(default=0.01, metadata={"help": "learning rate of ONE worker (scaled by the world size)"})
    scale_lr: bool = field(default=True, metadata={"help": "multiply the LR by workers x accumulation"})
    warmup_epochs: float = field(default=1.0, metadata={"help": "linear warm-up to the scaled LR, in epochs"})
    accumulation: int = field(default=1, metadata={"help": "micro-batches per optimizer step (backward_passes_per_step)"})
    fp16_allreduce: bool = field(default=False, metadata={"help": "compress gradients to fp16 for the all-reduce"})
    seed: int = field(default=42, metadata={"help": "one seed for the job; ranks derive theirs from it"})
    log_every: int = field(default=20, metadata={"help": "steps between log lines (rank 0)"})
    max_steps: Optional[int] = field(default=None, metadata={"help": "stop after this many optimizer steps"})
    num_workers: int = field(default=0, metadata={"help": "DataLoader worker processes per rank"})
    checkpoint_dir: Optional[str] = field(default=None, metadata={"help": "where rank 0 writes checkpoints (none: no checkpoints)"})
    checkpoint_every: int = field(default=0, metadata={"help": "steps between checkpoints (0: at the end of each epoch only)"})
    keep_checkpoints: int = field(default=3, metadata={"help": "checkpoints kept; older ones are deleted"})
    resume: bool = field(default=True, metadata={"help": "continue from the newest valid checkpoint in checkpoint_dir"})
    preempt_signal: str = field(default="USR1", metadata={"help": "signal that asks for checkpoint + requeue ('' disables)"})
    stall_timeout: float = field(default=600.0, metadata={"help": "seconds without a finished step before a rank ends the job, naming where it is stuck (0: never)"})
    elastic_commit_every: int = field(default=10, metadata={"help": "steps between in-memory commits under Horovod elastic (what a worker loss rolls back to)"})
    preempt_check_every: int = field(default=10, metadata={"help": "steps between the ranks' vote on a preemption signal"})

    def __post_init__(self) -> None:
        positive = ("epochs", "batch_size", "accumulation", "log_every", "keep_checkpoints",
                    "preempt_check_every", "elastic_commit_every")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name} must be a whole number >= 1, got {value!r}")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr must be > 0, got {self.lr!r}")
        if self.stall_timeout < 0:
            raise ValueError(f"TrainConfig.stall_timeout must be >= 0, got {self.stall_timeout!r}")
        if self.warmup_epochs < 0:
            raise ValueError(f"TrainConfig.warmup_epochs must be >= 0, got {self.warmup_epochs!r}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"TrainConfig.max_steps must be >= 1 or None, got {self.max_steps!r}")
        for name in ("num_workers", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)!r}")

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# Field annotations are strings here (postponed evaluation): map them to argparse types.
_ARG_TYPES = {"int": int, "float": float, "str": str, "Optional[int]": int, "Optional[str]": str}


def add_config_arguments(parser: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    """Add one flag per TrainConfig field, typed from the field, defaulting to ``defaults``."""
    for f in fields(TrainConfig):
        default = getattr(defaults, f.name)
        help_text = f"{f.metadata.get('help', '')} (default: {default})"
        if f.type == "bool":
            parser.add_argument(_flag(f.name), default=default, help=help_text,
                                action=argparse.BooleanOptionalAction)
        else:
            parser.add_argument(_flag(f.name), type=_ARG_TYPES[f.type], default=default,
                                help=help_text)


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(**{f.name: getattr(args, f.name) for f in fields(TrainConfig)})

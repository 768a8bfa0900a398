"""Rank-aware logging: rank 0 tells the story, the other ranks speak up only for warnings.

Every rank logs INFO to its own file in the run directory (when there is one), so what a
rank other than 0 saw is kept even though only its warnings reach the console.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # log files are also written by tools that never import torch or Horovod
    from hvdtrain.distributed.world import World


def get_logger(world: "World", name: str = "hvdtrain") -> logging.Logger:
    """A logger that prints INFO on rank 0 only and WARNING and above on every rank.

    Lines from ranks other than 0 carry the rank and host, so a warning in a 64-rank job
    says where it came from.
    """
    logger = logging.getLogger(f"{name}.rank{world.rank}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        prefix = "[hvdtrain]" if world.is_root else f"[hvdtrain rank {world.rank}@{world.hostname}]"
        handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
        handler.setLevel(logging.INFO if world.is_root else logging.WARNING)
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def add_file(logger: logging.Logger, path: Path, world: "World") -> logging.Handler:
    """Also log INFO and above to ``path`` (appended), each line stamped with time, rank and host."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(
        f"%(asctime)s rank {world.rank}@{world.hostname} %(levelname)s %(message)s"))
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler

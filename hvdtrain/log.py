"""Rank-aware logging: rank 0 tells the story, the other ranks speak up only for warnings."""
from __future__ import annotations

import logging
import sys

from hvdtrain.dist import World


def get_logger(world: World, name: str = "hvdtrain") -> logging.Logger:
    """A logger that prints INFO on rank 0 only and WARNING and above on every rank.

    Lines from ranks other than 0 carry the rank and host, so a warning in a 64-rank job
    says where it came from.
    """
    logger = logging.getLogger(f"{name}.rank{world.rank}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stdout)
        prefix = "[hvdtrain]" if world.is_root else f"[hvdtrain rank {world.rank}@{world.hostname}]"
        handler.setFormatter(logging.Formatter(f"{prefix} %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(logging.INFO if world.is_root else logging.WARNING)
    return logger

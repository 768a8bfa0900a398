"""Checkpoint files: written atomically, the last K kept, read back without unpickling code.

Only file handling lives here; who writes (rank 0) and how the state reaches the other ranks
(a broadcast) is the Trainer's business. A kill at any moment leaves every complete checkpoint
readable: a checkpoint is written to a temporary file, flushed to disk, then renamed into place,
and only then does the ``latest`` pointer move to it.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

FORMAT_VERSION = 1
LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
REQUIRED_KEYS = ("format", "model", "optimizer", "scheduler", "epoch", "step", "epoch_position",
                 "global_batch", "world_size")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which file and why."""


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable: the directory entry must reach the disk too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(path: Path, write) -> None:
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()
    _fsync_directory(path.parent)


class CheckpointStore:
    """The checkpoints of one run in one directory."""

    def __init__(self, directory: os.PathLike, keep: int = 3,
                 log: Optional[logging.Logger] = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest checkpoint is always kept), got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.log = log or logging.getLogger("hvdtrain.checkpoint")

    def save(self, state: Dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step``, move ``latest`` to it, drop the oldest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / checkpoint_name(step)
        _write_atomically(path, lambda handle: torch.save(state, handle))
        _write_atomically(self.directory / LATEST, lambda handle: handle.write(path.name.encode() + b"\n"))
        self._prune()
        return path

    def steps(self) -> List[Tuple[int, Path]]:
        """Complete checkpoints, newest first (temporary files of an interrupted save never match)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name)
            if match:
                found.append((int(match.group(1)), path))
        return sorted(found, reverse=True)

    def _prune(self) -> None:
        for _, path in self.steps()[self.keep:]:
            path.unlink(missing_ok=True)

    def latest_pointer(self) -> Optional[str]:
        try:
            return (self.directory / LATEST).read_text().strip() or None
        except OSError:
            return None

    @staticmethod
    def read(path: Path) -> Dict[str, Any]:
        """Load one checkpoint: tensors and plain values only (``weights_only``), never code."""
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # truncated, corrupt, or holding objects we refuse to unpickle
            raise CheckpointError(f"{path} is unreadable: {type(error).__name__}: {error}") from None
        missing = [key for key in REQUIRED_KEYS if key not in state] if isinstance(state, dict) else REQUIRED_KEYS
        if missing:
            raise CheckpointError(f"{path} is not an hvdtrain checkpoint: missing {', '.join(missing)}")
        if state["format"] != FORMAT_VERSION:
            raise CheckpointError(f"{path} has format {state['format']}, this hvdtrain reads {FORMAT_VERSION}")
        return state

    def read_newest_valid(self) -> Optional[Tuple[Path, Dict[str, Any]]]:
        """The newest checkpoint that loads; each newer one that does not is reported and skipped."""
        pointer = self.latest_pointer()
        for _, path in self.steps():
            try:
                state = self.read(path)
            except CheckpointError as error:
                self.log.warning(f"{error}; falling back to the previous checkpoint")
                continue
            if pointer and pointer != path.name:
                self.log.warning(f"'latest' names {pointer} but {path.name} is the newest valid checkpoint")
            return path, state
        return None

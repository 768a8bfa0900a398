"""The checkpoints of one run in one directory: the full format (``ckpt-NNNNNNNNN.pt``), both kinds
listed, ``latest``, the last K kept, read back without unpickling code.

Files are written atomically and ``latest`` moves only after: a kill leaves every complete
checkpoint readable. The newest complete one of either kind is read; at the same step the full one
wins (a consolidated checkpoint beside its sharded directory).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint import FORMAT_VERSION, CheckpointError
from hvdtrain.checkpoint.formats.run_state import RunState, missing_keys
from hvdtrain.common import io_watch
from hvdtrain.common.atomic import write_atomically

LATEST = "latest"
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
# hvdtrain.common.atomic's temporary file of a save (or of `latest`) that was killed before its rename.
_UNFINISHED = re.compile(r"^\.(ckpt-\d{9}\.pt|latest)\.tmp-\d+$")
REQUIRED_KEYS = ("format", "model", "optimizer") + RunState.FULL
__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointStore", "checkpoint_name"]


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


class CheckpointStore:
    """The checkpoints of one run in one directory."""

    def __init__(self, directory: os.PathLike, keep: int = 3,
                 log: Optional[logging.Logger] = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest checkpoint is always kept), got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.log = log or logging.getLogger("hvdtrain.checkpoint.formats.full")

    def save(self, state: Dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step``, move ``latest`` to it, drop the oldest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / checkpoint_name(step)
        write_atomically(path, lambda handle: torch.save(state, handle))
        self.point_latest_at(path, step)
        return path

    def point_latest_at(self, path: Path, step: int) -> None:
        """``latest`` names the checkpoint of ``step`` just written (a file or a directory); older ones go."""
        write_atomically(self.directory / LATEST, lambda handle: handle.write(path.name.encode() + b"\n"))
        self._prune(step)

    def steps(self) -> List[Tuple[int, Path]]:
        """Checkpoints of both kinds, newest first, a full one before a sharded one of the same step
        (the temporary files and hidden directories of an interrupted save never match)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _NAME.match(path.name) or (sharded.DIRECTORY.match(path.name) if path.is_dir() else None)
            if match:
                found.append((int(match.group(1)), path.is_file(), path))
        return [(step, path) for step, _, path in sorted(found, reverse=True)]

    def _prune(self, written: int) -> None:
        """Keep the newest ``keep`` steps up to the one just ``written`` (itself always), of either kind
        (a consolidated file stays with the directory it came from). A newer checkpoint than the one
        written is not this run's to delete (an unreadable one it fell back from): it stays."""
        kept = sorted({step for step, _ in self.steps() if step <= written} | {written}, reverse=True)[:self.keep]
        for step, path in self.steps():
            if step > written or step in kept:
                continue
            if path.is_dir():
                sharded.remove(path)
            else:
                path.unlink(missing_ok=True)
        sharded.remove_leftovers(self.directory)

    def remove_leftovers(self) -> Tuple[int, int]:
        """Delete what killed saves left (temporary files and directories, never read as checkpoints;
        each can be a whole checkpoint's size); how many, and the bytes freed. Only while no save
        runs: at start."""
        removed = freed = 0
        for path in self.directory.iterdir():
            if _UNFINISHED.match(path.name) and path.is_file():
                freed += path.stat().st_size
                path.unlink(missing_ok=True)
            elif sharded.LEFTOVER.match(path.name) and path.is_dir():
                freed += sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
                shutil.rmtree(path, ignore_errors=True)
            else:
                continue
            removed += 1
        return removed, freed

    def latest_pointer(self) -> Optional[str]:
        try:
            return (self.directory / LATEST).read_text().strip() or None
        except OSError:
            return None

    @staticmethod
    def read(path: Path, mmap: bool = False) -> Dict[str, Any]:
        """Load one checkpoint: tensors and plain values only (``weights_only``), never code. Of a
        sharded one, its manifest only: each rank reads its own file when it loads. ``mmap``: the
        tensors stay in the file until read (an export reads one at a time)."""
        if path.is_dir():
            return sharded.read_manifest(path)
        try:
            with io_watch.watching(path, "read"):
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as error:  # truncated, corrupt, or holding objects we refuse to unpickle
            raise CheckpointError(f"{path} is unreadable: {type(error).__name__}: {error}") from None
        missing = missing_keys(state, REQUIRED_KEYS)
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
            if pointer and pointer not in (path.name, path.stem):  # ckpt-N.pt consolidated from ckpt-N/
                self.log.warning(f"'latest' names {pointer} but {path.name} is the newest valid checkpoint")
            return path, state
        return None

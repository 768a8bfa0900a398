"""The checkpoints of one run in one directory: the full format (``ckpt-NNNNNNNNN.pt``), both kinds
listed, ``latest``, the last K kept, read back without unpickling code.

Files are written atomically and ``latest`` moves only after: a kill leaves every complete
checkpoint readable. The newest complete one of either kind is read; at the same step the full one
wins (a consolidated checkpoint beside its sharded directory).

A full checkpoint's checksum is hashed while torch.save writes it (hvdtrain.checkpoint.formats.
checksums) and written beside it, atomically, before ``latest`` moves: ``ckpt-000000030.pt.checksum``
(its bytes and xxh3_128, JSON). A file without one (written before, or by hand) still loads, with a
warning. A checkpoint found corrupt at start is set aside (``set_aside``: renamed to
``ckpt-000000030.pt.corrupt`` or ``ckpt-000000030.corrupt``, which no listing matches, so it is
never resumed nor pruned) and the previous one is read.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch

from hvdtrain.checkpoint.formats import checksums, sharded
from hvdtrain.checkpoint import FORMAT_VERSION, CheckpointError, CorruptCheckpoint
from hvdtrain.checkpoint.formats.run_state import RunState, missing_keys
from hvdtrain.common import io_watch
from hvdtrain.common.atomic import fsync_directory, write_atomically

LATEST = "latest"
CHECKSUM = ".checksum"  # a full checkpoint's checksum file: its name and this
CORRUPT = ".corrupt"  # a checkpoint set aside: its name and this
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_CHECKSUM = re.compile(r"^(ckpt-\d{9}\.pt)\.checksum$")
# hvdtrain.common.atomic's temporary file of a save (or of `latest`) that was killed before its rename.
_UNFINISHED = re.compile(r"^\.(ckpt-\d{9}\.pt(\.checksum)?|latest)\.tmp-\d+$")
REQUIRED_KEYS = ("format", "model", "optimizer") + RunState.FULL
__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointStore", "checkpoint_name", "write_full"]
_log = logging.getLogger("hvdtrain.checkpoint.formats.full")


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def checksum_path(path: Path) -> Path:
    """Where a full checkpoint's checksum is written: beside it, its name and ``.checksum``."""
    return Path(path).with_name(Path(path).name + CHECKSUM)


def write_full(path: Path, state: Dict[str, Any]) -> Path:
    """``state`` as a full checkpoint at ``path``, then its checksum beside it, each atomically; the
    checksum is hashed as torch.save writes. A kill between them leaves a complete file without a
    checksum (read with a warning), never a checksum of another file: a step's old one goes first."""
    path = Path(path)
    sidecar = checksum_path(path)
    sidecar.unlink(missing_ok=True)
    written: Dict[str, Any] = {}

    def write(handle) -> None:
        writer = checksums.HashingWriter(handle)
        torch.save(state, writer)
        handle.flush()
        written.update(writer.record(Path(handle.name)))
    write_atomically(path, write)
    text = json.dumps({"name": path.name, **written})
    write_atomically(sidecar, lambda handle: handle.write(text.encode()))
    return path


def verify_full(path: Path, log: Optional[logging.Logger] = None) -> bool:
    """Check a full checkpoint against its checksum file: CorruptCheckpoint naming the file and what
    differs; False (and a warning) when it has none (written before checksums, or by hand)."""
    sidecar = checksum_path(path)
    try:
        record = json.loads(sidecar.read_text())
    except FileNotFoundError:
        (log or _log).warning(f"{path} has no checksum ({sidecar.name}): it is read unverified (written by an "
                              f"hvdtrain before checksums, or by hand)")
        return False
    except (OSError, ValueError) as error:
        raise CorruptCheckpoint(f"{sidecar} is unreadable: {type(error).__name__}: {error}") from None
    if not isinstance(record, dict) or not isinstance(record.get("bytes"), int) or not checksums.recorded(record)[0]:
        raise CorruptCheckpoint(f"{sidecar} is not a checksum file: it needs bytes and one of "
                                f"{', '.join(checksums.ALGORITHMS)}")
    checksums.check(path, record, str(sidecar))
    return True


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
        path = write_full(self.directory / checkpoint_name(step), state)
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
                checksum_path(path).unlink(missing_ok=True)
        sharded.remove_leftovers(self.directory)

    def remove_leftovers(self) -> Tuple[int, int]:
        """Delete what killed saves left (temporary files and directories, never read as checkpoints;
        each can be a whole checkpoint's size, and the checksum of a file gone); how many, and the
        bytes freed. A sharded save killed once its manifest was written (between publish's renames)
        is put in place first (sharded.recover_publish): it is complete. Only while no save runs: at start."""
        for restored in sharded.recover_publish(self.directory):
            self.log.warning(f"restored {restored}: its save was killed between its last renames, complete")
        removed = freed = 0
        for path in self.directory.iterdir():
            orphan = _CHECKSUM.match(path.name)
            if (_UNFINISHED.match(path.name) or (orphan and not (self.directory / orphan.group(1)).exists())) \
                    and path.is_file():
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
    def read(path: Path, mmap: bool = False, log: Optional[logging.Logger] = None,
             verify: bool = True) -> Dict[str, Any]:
        """Load one checkpoint: tensors and plain values only (``weights_only``), never code. Of a
        sharded one, its manifest only: its files are verified by the ranks (coordination) or by
        read_newest_valid(verify_shards=True).

        Args:
            path: a full checkpoint's file or a sharded one's directory.
            mmap: the tensors stay in the file until read (an export reads one at a time).
            log: where a full checkpoint without a checksum file is warned of.
            verify: a full one's checksum is checked first (CorruptCheckpoint when it differs);
                False: checked already by the caller.
        """
        path = Path(path)
        if path.is_dir():
            return sharded.read_manifest(path)
        if verify:
            verify_full(path, log)
        try:
            with io_watch.watching(path, "read"):
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as error:  # truncated, corrupt, or holding objects we refuse to unpickle
            raise CorruptCheckpoint(f"{path} is unreadable: {type(error).__name__}: {error}") from None
        missing = missing_keys(state, REQUIRED_KEYS)
        if missing:
            raise CheckpointError(f"{path} is not an hvdtrain checkpoint: missing {', '.join(missing)}")
        if state["format"] != FORMAT_VERSION:
            raise CheckpointError(f"{path} has format {state['format']}, this hvdtrain reads {FORMAT_VERSION}")
        return state

    def read_newest_valid(self, set_aside: bool = False, verify_shards: bool = False
                          ) -> Optional[Tuple[Path, Dict[str, Any]]]:
        """The newest checkpoint that loads; each newer one that does not is reported and skipped.

        Args:
            set_aside: a corrupt one (CorruptCheckpoint: a checksum, a size, a file unreadable) is
                renamed out of the listing (``set_aside``), not only skipped: the run's owner at start.
            verify_shards: a sharded one's files are checked against its manifest here, every one
                (else only their sizes: the ranks share the checksums, coordination's pre-check).
        """
        pointer = self.latest_pointer()
        for _, path in self.steps():
            try:
                state = self.read(path, log=self.log)
                if verify_shards and path.is_dir():
                    for rank in range(state["world_size"]):
                        sharded.check_file(path, state, rank)
            except CorruptCheckpoint as error:
                self.report_corrupt(path, str(error), set_aside)
                continue
            except CheckpointError as error:
                self.log.warning(f"{error}; falling back to the previous checkpoint")
                continue
            if pointer and pointer not in (path.name, path.stem):  # ckpt-N.pt consolidated from ckpt-N/
                self.log.warning(f"'latest' names {pointer} but {path.name} is the newest valid checkpoint")
            return path, state
        return None

    def report_corrupt(self, path: Path, problem: str, set_aside: bool) -> None:
        """A warning naming the corrupt checkpoint ``path`` and what failed; ``set_aside``: renamed
        out of the listing first (the warning names where it went)."""
        where = f"set aside as {self.set_aside(path).name}" if set_aside else "skipped"
        self.log.warning(f"the checkpoint {path} is corrupt ({problem}): {where}; falling back to the "
                         f"previous checkpoint")

    def set_aside(self, path: Path) -> Path:
        """Rename the checkpoint ``path`` (a file, with its checksum, or a directory) to a name no
        listing matches (``ckpt-N.pt.corrupt``, ``ckpt-N.corrupt``; ``.corrupt-2``... if taken): never
        resumed, never pruned, kept for the user to inspect. Returns its new path."""
        path = Path(path)
        target, count = path.with_name(path.name + CORRUPT), 1
        while target.exists():
            count += 1
            target = path.with_name(f"{path.name}{CORRUPT}-{count}")
        os.replace(path, target)
        if checksum_path(path).exists():
            os.replace(checksum_path(path), checksum_path(target))
        fsync_directory(self.directory)
        return target

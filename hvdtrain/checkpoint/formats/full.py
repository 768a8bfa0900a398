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
never resumed nor pruned) and the previous one is read. Only corruption sets a checkpoint aside
(hvdtrain.checkpoint.formats.loading): any other failure to read the newest one stops the run,
naming it, and where checkpoints existed but none is left to resume, the run refuses to start
rather than train from step 0 (``train.resume=false`` starts anew).

While a run owns the directory (hvdtrain.checkpoint.ownership), ``fence`` is its lease's check,
called right before each irreversible step (a rename into place, ``latest``, a prune), and
``stamp`` its claim, written into each checksum file and manifest. A checkpoint whose claim is of an
older generation than a checkpoint of an earlier step was published by an owner deposed meanwhile
(a takeover happened before it, yet it came after): a resume sets it aside as ``.deposed``.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from hvdtrain.checkpoint.formats import checksums, loading, sharded
from hvdtrain.checkpoint import FORMAT_VERSION, CheckpointError, CorruptCheckpoint
from hvdtrain.checkpoint.formats.run_state import RunState, missing_keys
from hvdtrain.common import io_watch
from hvdtrain.common.atomic import fsync_directory, write_atomically

LATEST = "latest"
CHECKSUM = ".checksum"  # a full checkpoint's checksum file: its name and this
CORRUPT = ".corrupt"  # a checkpoint set aside as corrupt: its name and this
DEPOSED = ".deposed"  # a checkpoint set aside as published by a deposed owner: its name and this
_NAME = re.compile(r"^ckpt-(\d{9})\.pt$")
_CHECKSUM = re.compile(r"^(ckpt-\d{9}\.pt)\.checksum$")
# hvdtrain.common.atomic's temporary file of a save (or of `latest`) that was killed before its rename.
_UNFINISHED = re.compile(r"^\.(ckpt-\d{9}\.pt(\.checksum)?|latest)\.tmp-\d+$")
# A checkpoint set aside (set_aside): as corrupt, or as published by a deposed owner.
_SET_ASIDE = re.compile(r"^ckpt-\d{9}(\.pt)?\.(corrupt|deposed)(-\d+)?$")
REQUIRED_KEYS = ("format", "model", "optimizer") + RunState.FULL
__all__ = ["FORMAT_VERSION", "CheckpointError", "CheckpointStore", "checkpoint_name", "write_full"]
_log = logging.getLogger("hvdtrain.checkpoint.formats.full")


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def checksum_path(path: Path) -> Path:
    """Where a full checkpoint's checksum is written: beside it, its name and ``.checksum``."""
    return Path(path).with_name(Path(path).name + CHECKSUM)


def unfenced() -> None:
    """No lease to check (a tool writing outside a run, or a run that let the directory go)."""


def write_full(path: Path, state: Dict[str, Any], fence: Callable[[], None] = unfenced,
               stamp: Optional[Dict[str, Any]] = None) -> Path:
    """``state`` as a full checkpoint at ``path``, then its checksum beside it, each atomically; the
    checksum is hashed as torch.save writes. A kill between them leaves a complete file without a
    checksum (read with a warning), never a checksum of another file: a step's old one goes first.

    Args:
        path: where the checkpoint goes.
        state: what it holds; refused (CheckpointError, nothing written) when a value in it would not
            load back (loading.check_loadable).
        fence: called right before each irreversible step (the old checksum's removal, each rename).
        stamp: the lease's claim, recorded in the checksum file.
    """
    path = Path(path)
    loading.check_loadable(state, "the checkpoint's state")
    sidecar = checksum_path(path)
    written: Dict[str, Any] = {}

    def write(handle) -> None:
        writer = checksums.HashingWriter(handle)
        torch.save(state, writer)
        handle.flush()
        written.update(writer.record(Path(handle.name)))

    def replace_old() -> None:  # fenced before each irreversible call: the old checksum's removal, the rename
        fence()
        sidecar.unlink(missing_ok=True)
        fence()
    write_atomically(path, write, before_rename=replace_old)
    text = json.dumps({"name": path.name, **written, **({"lease": stamp} if stamp else {})})
    write_atomically(sidecar, lambda handle: handle.write(text.encode()), before_rename=fence)
    return path


def verify_full(path: Path, log: Optional[logging.Logger] = None) -> bool:
    """Check a full checkpoint against its checksum file: CorruptCheckpoint naming the file and what
    differs; False (and a warning) when it has none (written before checksums, or by hand);
    CheckpointError when the file system fails to read it (not the checkpoint's fault)."""
    sidecar = checksum_path(path)
    try:
        with io_watch.watching(sidecar, "read"):
            record = json.loads(sidecar.read_text())
    except FileNotFoundError:
        (log or _log).warning(f"{path} has no checksum ({sidecar.name}): it is read unverified (written by an "
                              f"hvdtrain before checksums, or by hand)")
        return False
    except OSError as error:
        raise loading.read_failure(sidecar, error, verified=False) from None
    except ValueError as error:
        raise CorruptCheckpoint(f"{sidecar} is garbled: {type(error).__name__}: {error}") from None
    if not isinstance(record, dict) or not isinstance(record.get("bytes"), int) or not checksums.recorded(record)[0]:
        raise CorruptCheckpoint(f"{sidecar} is not a checksum file: it needs bytes and one of "
                                f"{', '.join(checksums.ALGORITHMS)}")
    checksums.check(path, record, str(sidecar))
    return True


def lease_of(path: Path) -> Optional[Dict[str, Any]]:
    """The claim a checkpoint was published under (its checksum file's or manifest's ``lease``), or
    None (published before fencing, by a tool, or unreadable: then not judged)."""
    record = Path(path) / sharded.MANIFEST if Path(path).is_dir() else checksum_path(path)
    try:
        found = json.loads(record.read_text()).get("lease")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, dict) and isinstance(found.get("generation"), int) else None


class CheckpointStore:
    """The checkpoints of one run in one directory."""

    def __init__(self, directory: os.PathLike, keep: int = 3,
                 log: Optional[logging.Logger] = None) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the newest checkpoint is always kept), got {keep}")
        self.directory = Path(directory)
        self.keep = keep
        self.log = log or logging.getLogger("hvdtrain.checkpoint.formats.full")
        # Set by the run that owns the directory (hvdtrain.checkpoint.coordination): its lease's
        # check before each irreversible step, and its claim written into what it publishes.
        self.fence: Callable[[], None] = unfenced
        self.stamp: Optional[Dict[str, Any]] = None

    def save(self, state: Dict[str, Any], step: int) -> Path:
        """Write ``state`` as the checkpoint of ``step``, move ``latest`` to it, drop the oldest."""
        self.directory.mkdir(parents=True, exist_ok=True)
        io_watch.progress()
        path = write_full(self.directory / checkpoint_name(step), state, self.fence, self.stamp)
        self.point_latest_at(path, step)
        return path

    def point_latest_at(self, path: Path, step: int) -> None:
        """``latest`` names the checkpoint of ``step`` just written (a file or a directory); older ones go."""
        write_atomically(self.directory / LATEST, lambda handle: handle.write(path.name.encode() + b"\n"),
                         before_rename=self.fence)
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
        doomed = [path for step, path in self.steps() if step <= written and step not in kept]
        if doomed:
            self.fence()
        for path in doomed:
            if path.is_dir():
                sharded.remove(path)
            else:
                path.unlink(missing_ok=True)
                checksum_path(path).unlink(missing_ok=True)
            io_watch.progress()
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
            io_watch.progress()
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

        Raises CorruptCheckpoint only when its bytes are not as written; CheckpointError for
        anything else (hvdtrain.checkpoint.formats.loading).

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
        verified = verify_full(path, log) if verify else True
        with io_watch.watching(path, "read"):
            state = loading.load(path, verified=verified, mmap=mmap)
        missing = missing_keys(state, REQUIRED_KEYS)
        if missing:
            raise CheckpointError(f"{path} is not an hvdtrain checkpoint: missing {', '.join(missing)}. Move it out of "
                                  f"the checkpoint directory")
        if state["format"] != FORMAT_VERSION:
            raise CheckpointError(f"{path} has format {state['format']}, this hvdtrain reads {FORMAT_VERSION}: resume "
                                  f"it with the hvdtrain that wrote it")
        return state

    def read_newest_valid(self, set_aside: bool = False, verify_shards: bool = False
                          ) -> Optional[Tuple[Path, Dict[str, Any]]]:
        """The newest checkpoint that loads; each newer one that is corrupt is reported and skipped.
        Any other failure to read one (the file system, memory, a value it will not load, another
        format) raises CheckpointError naming it: a resume never falls back past a good checkpoint.

        Args:
            set_aside: the run's owner at start: a corrupt one (CorruptCheckpoint: a checksum, a size,
                a file unreadable) is renamed out of the listing (``set_aside``), not only skipped,
                as is one published by a deposed owner; and when checkpoints existed but none is left
                to resume, CheckpointError rather than None (a run would start from step 0).
            verify_shards: a sharded one's files are checked against its manifest here, every one
                (else only their sizes: the ranks share the checksums, coordination's pre-check).
        """
        pointer = self.latest_pointer()
        listed = self.steps()
        deposed = self._deposed(listed) if set_aside else {}
        for _, path in listed:
            if path in deposed:
                self.report_deposed(path, deposed[path])
                continue
            try:
                state = self.read(path, log=self.log)
                if verify_shards and path.is_dir():
                    for rank in range(state["world_size"]):
                        sharded.check_file(path, state, rank)
            except CorruptCheckpoint as error:
                self.report_corrupt(path, str(error), set_aside)
                continue
            except OSError as error:  # the file system, not the checkpoint
                raise loading.read_failure(path, error, verified=False) from None
            if pointer and pointer not in (path.name, path.stem):  # ckpt-N.pt consolidated from ckpt-N/
                self.log.warning(f"'latest' names {pointer} but {path.name} is the newest valid checkpoint")
            return path, state
        if set_aside:
            self._refuse_to_start_over(pointer)
        return None

    def _deposed(self, listed: List[Tuple[int, Path]]) -> Dict[Path, str]:
        """The checkpoints published by a deposed owner (module text), each with why."""
        claims = [(step, path, lease_of(path)) for step, path in listed]
        found = {}
        for step, path, lease in claims:
            if lease is None:
                continue
            later = [(earlier_step, earlier) for earlier_step, _, earlier in claims
                     if earlier is not None and earlier_step < step and earlier["generation"] > lease["generation"]]
            if later:
                earlier_step, earlier = later[0]
                found[path] = (f"published under the directory's claim {lease['generation']}, though claim "
                               f"{earlier['generation']} had published step {earlier_step} before it: its owner "
                               f"was deposed before it published")
        return found

    def _refuse_to_start_over(self, pointer: Optional[str]) -> None:
        """CheckpointError when this directory held checkpoints (set aside, or named by ``latest``)
        and none is left to resume: training from step 0 over them would lose the run silently."""
        aside = sorted(path.name for path in self.directory.iterdir()
                       if _SET_ASIDE.match(path.name))
        if not aside and not pointer:
            return
        held = (f"only checkpoints set aside ({', '.join(aside[:5])}{', ...' if len(aside) > 5 else ''})" if aside
                else f"no checkpoint, though 'latest' names {pointer}")
        raise CheckpointError(
            f"checkpoint_dir {self.directory} holds {held}: nothing to resume, and starting from step 0 would "
            f"silently lose the run. Restore a good copy of a checkpoint there, or start anew with "
            f"train.resume=false (what was set aside stays for you to inspect)")

    def report_corrupt(self, path: Path, problem: str, set_aside: bool) -> None:
        """A warning naming the corrupt checkpoint ``path`` and what failed; ``set_aside``: renamed
        out of the listing first (the warning names where it went)."""
        where = f"set aside as {self.set_aside(path).name}" if set_aside else "skipped"
        self.log.warning(f"the checkpoint {path} is corrupt ({problem}): {where}; falling back to the "
                         f"previous checkpoint")

    def report_deposed(self, path: Path, why: str) -> None:
        """A warning naming the checkpoint ``path`` published by a deposed owner, set aside first."""
        target = self.set_aside(path, DEPOSED)
        self.log.warning(f"the checkpoint {path} was {why}: set aside as {target.name}; falling back to the "
                         f"previous checkpoint")

    def set_aside(self, path: Path, suffix: str = CORRUPT) -> Path:
        """Rename the checkpoint ``path`` (a file, with its checksum, or a directory) to a name no
        listing matches (``ckpt-N.pt.corrupt``, ``ckpt-N.corrupt``, ``.deposed``; ``-2``... if taken):
        never resumed, never pruned, kept for the user to inspect. Returns its new path."""
        path = Path(path)
        target, count = path.with_name(path.name + suffix), 1
        while target.exists():
            count += 1
            target = path.with_name(f"{path.name}{suffix}-{count}")
        os.replace(path, target)
        if checksum_path(path).exists():
            os.replace(checksum_path(path), checksum_path(target))
        fsync_directory(self.directory)
        return target

    def generation_floor(self) -> int:
        """The highest claim generation among the listed checkpoints (0: none recorded): a new
        claim of the directory takes the next one."""
        return max((lease["generation"] for _, path in self.steps() if (lease := lease_of(path))), default=0)

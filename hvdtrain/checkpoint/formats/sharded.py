"""Sharded checkpoints on disk: one file per rank and a manifest, published as one directory.

    ckpt-000000030/
      manifest.json            strategy, world size, step, each file's bytes and checksum, the run state
      rank-00000-of-00002.pt   a rank's slices, the layout to reassemble them, and its RNG states

Every rank writes its file into a hidden ``.ckpt-000000030.tmp-TOKEN/`` (TOKEN: the claim of the
run that owns the directory, so that an owner deposed meanwhile never writes into its successor's
save), hashing it as it writes (xxh3_128: hvdtrain.checkpoint.formats.checksums; manifests written
before hold sha256, still checked); rank 0 checks them, writes the manifest (with the claim's
stamp) and renames the directory into place, then ``latest`` moves, each irreversible step fenced
by the lease (hvdtrain.checkpoint.ownership): a kill leaves no directory or a complete one.
Re-saving a step renames the old directory to ``.ckpt-000000030.old`` first: a kill between the
two renames leaves the complete temporary directory, which the next start puts in place
(recover_publish). An asynchronous save's ranks tell rank 0 their file is written through a
record beside it (``rank-00001.json``: its bytes and checksum, or why it failed), not a
collective. Which rank does what is hvdtrain.checkpoint.coordination's.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from hvdtrain.checkpoint import CheckpointError, CorruptCheckpoint
from hvdtrain.checkpoint.formats import checksums, loading
from hvdtrain.checkpoint.formats.run_state import RunState, expert_parallel_of, missing_keys
from hvdtrain.common import io_watch
from hvdtrain.common.atomic import fsync_directory, write_atomically

SHARDED_FORMAT = 1
KIND = "sharded"
MANIFEST = "manifest.json"
DIRECTORY = re.compile(r"^ckpt-(\d{9})$")
LEFTOVER = re.compile(r"^\.ckpt-(\d{9})\.(tmp|old)(-[0-9a-f]+)?$")  # an interrupted save, or a deletion
RUN_KEYS = RunState.SHARDED
OPTIONAL_RUN_KEYS = RunState.SHARDED_OPTIONAL
_MANIFEST_KEYS = ("format", "kind", "strategy", "world_size", "step", "files") + RUN_KEYS


def directory_name(step: int) -> str:
    return f"ckpt-{step:09d}"


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}.pt"


def temporary_directory(directory: Path, step: int, token: str = "") -> Path:
    """Where the save of ``step`` under the claim ``token`` writes its files ("": a tool's, unclaimed)."""
    return Path(directory) / (f".{directory_name(step)}.tmp" + (f"-{token[:16]}" if token else ""))


def is_sharded(state: Dict[str, Any]) -> bool:
    return state.get("kind") == KIND


# Writing.

def prepare(temporary: Path) -> None:
    """Rank 0, before any rank writes: an empty temporary directory (a killed save's is removed)."""
    if temporary.exists():
        shutil.rmtree(temporary)
        io_watch.progress()
    temporary.mkdir(parents=True)


def write_shard(temporary: Path, rank: int, world_size: int, state: Dict[str, Any]) -> Dict[str, Any]:
    """One rank's file, flushed to disk; what the manifest records of it.

    Args:
        temporary: the save's hidden directory (temporary_directory); made here if missing.
        rank: the rank writing.
        world_size: how many ranks write a file (in the file's name).
        state: what the file holds besides its format, rank and world size: the strategy's part, the RNG states;
            refused (CheckpointError, nothing written) when a value in it would not load back.
    """
    shard = {"format": SHARDED_FORMAT, "rank": rank, "world_size": world_size, **state}
    loading.check_loadable(shard, f"rank {rank}'s part of the checkpoint")
    temporary.mkdir(parents=True, exist_ok=True)  # rank 0 made it, if the ranks share the disk
    path = temporary / shard_name(rank, world_size)
    with io_watch.watching(path, "write") as activity, open(path, "wb") as handle:
        writer = checksums.HashingWriter(activity.counting(handle))
        torch.save(shard, writer)
        handle.flush()
        os.fsync(handle.fileno())
    return {"name": path.name, "rank": rank, **writer.record(path)}


def record_name(rank: int) -> str:
    return f"rank-{rank:05d}.json"


def write_record(temporary: Path, rank: int, record: "Dict[str, Any] | str") -> None:
    """Rank ``rank``'s word to rank 0 that its file is written (write_shard's record) or failed (why)."""
    text = json.dumps(record if isinstance(record, dict) else {"rank": rank, "failure": record})
    write_atomically(Path(temporary) / record_name(rank), lambda handle: handle.write(text.encode()))


def wait_for_records(temporary: Path, world_size: int, timeout: float,
                     stop: Callable[[], bool] = lambda: False, poll: float = 0.02) -> List[Dict[str, Any]]:
    """Rank 0: every rank's record, in rank order, once all are there; CheckpointError naming the ranks
    that failed or wrote nothing in time (a directory not shared by every rank), or when the run ended.

    Args:
        temporary: the save's hidden directory, where the records are written.
        world_size: how many records to wait for.
        timeout: seconds to wait for every record.
        stop: ``stop()`` is True once the run has ended: waiting stops.
        poll: seconds between looks at the directory.
    """
    deadline = time.monotonic() + timeout
    records: Dict[int, Dict[str, Any]] = {}
    while True:
        for rank in range(world_size):
            path = Path(temporary) / record_name(rank)
            if rank not in records and path.is_file():
                records[rank] = json.loads(path.read_text())
            io_watch.progress()  # the file system answered: waiting on the ranks, not stuck on it
        failed = [f"rank {rank}: {record['failure']}" for rank, record in sorted(records.items())
                  if "failure" in record]
        if failed:
            raise CheckpointError("; ".join(failed))
        if len(records) == world_size:
            for rank in range(world_size):
                (Path(temporary) / record_name(rank)).unlink()
            return [records[rank] for rank in range(world_size)]
        if stop():
            raise CheckpointError(f"the run ended before every rank had written its file into {temporary}")
        if time.monotonic() > deadline:
            silent = [rank for rank in range(world_size) if rank not in records]
            raise CheckpointError(
                f"rank 0 saw no word from rank(s) {silent} in {temporary} after {timeout:.0f} s: checkpoint_dir is "
                f"not one directory shared by every rank, or they are stuck. Put it on a filesystem every host "
                f"mounts (hvdtrain doctor --checkpoint-dir DIR checks it), or use checkpoint_format=full")
        time.sleep(poll)


def publish(directory: Path, step: int, strategy: str, files: Sequence[Dict[str, Any]],
            run_state: Dict[str, Any], temporary: Optional[Path] = None,
            fence: Callable[[], None] = lambda: None, stamp: Optional[Dict[str, Any]] = None) -> Path:
    """Rank 0, once every rank has written: check the files, write the manifest, rename into place.
    Returns the checkpoint's directory.

    Args:
        directory: the checkpoint directory (train.checkpoint_dir).
        step: the optimizer step saved, naming the checkpoint.
        strategy: the strategy's name, recorded in the manifest.
        files: what write_shard returned on each rank, in rank order.
        run_state: the run state the manifest records (RunState.SHARDED's keys, SHARDED_OPTIONAL's if there).
        temporary: where the ranks wrote (temporary_directory; None: a tool's, unclaimed).
        fence: called right before each irreversible step (the lease's check).
        stamp: the lease's claim, recorded in the manifest.
    """
    temporary = temporary or temporary_directory(directory, step)
    for record in files:
        path = temporary / record["name"]
        if not path.is_file() or path.stat().st_size != record["bytes"]:
            raise CheckpointError(
                f"rank {record['rank']} wrote {record['name']} ({record['bytes']} bytes) into {temporary}, but "
                f"rank 0 {'sees another size' if path.is_file() else 'does not see it'}: checkpoint_dir "
                f"{directory} is not one directory shared by every rank. Put it on a filesystem every host "
                f"mounts (hvdtrain doctor --checkpoint-dir DIR checks it), or use checkpoint_format=full")
    manifest = {"format": SHARDED_FORMAT, "kind": KIND, "strategy": strategy, "world_size": len(files),
                "step": step, "files": list(files), **{key: run_state[key] for key in RUN_KEYS},
                **{key: run_state[key] for key in OPTIONAL_RUN_KEYS if key in run_state},
                **({"lease": stamp} if stamp else {})}
    try:
        text = json.dumps(manifest, indent=1)
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"the run state cannot be written as JSON: {error}") from None
    write_atomically(temporary / MANIFEST, lambda handle: handle.write(text.encode()))
    final = Path(directory) / directory_name(step)
    fence()
    if final.exists():  # the same step saved again (a resumed run): the old one goes
        old = Path(directory) / f".{final.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        fence()
    os.replace(temporary, final)
    fsync_directory(Path(directory))
    return final


def remove(path: Path) -> None:
    """Delete a checkpoint directory; renamed first, so a kill never leaves a partial one visible."""
    hidden = path.with_name(f".{path.name}.old")
    shutil.rmtree(hidden, ignore_errors=True)
    os.replace(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def recover_publish(directory: Path) -> List[Path]:
    """The checkpoints whose publish was killed after its manifest was written, put in place; returns
    them. Such a temporary directory is complete (rank 0 writes the manifest last, atomically, once
    every file is there): killed between publish's two renames (the step's previous directory moved
    to ``.ckpt-N.old``, the new one not yet in place), or just before them. Where the step's
    directory exists the kill came before the first rename: that one stays, as if the save never
    ran. Only while no save runs: at start."""
    restored = []
    for path in sorted(Path(directory).iterdir()):
        match = LEFTOVER.match(path.name)
        if not match or match.group(2) != "tmp" or not (path / MANIFEST).is_file():
            continue
        final = Path(directory) / directory_name(int(match.group(1)))
        if not final.exists():
            os.replace(path, final)
            restored.append(final)
        io_watch.progress()
    if restored:
        fsync_directory(Path(directory))
    return restored


def remove_leftovers(directory: Path) -> None:
    """Delete the hidden directories of interrupted saves or deletions (never read as checkpoints).
    Rank 0 calls it after a save, when no rank is writing."""
    for path in Path(directory).iterdir():
        if LEFTOVER.match(path.name) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
            io_watch.progress()


# Reading.

def read_manifest(path: Path) -> Dict[str, Any]:
    """A sharded checkpoint's manifest, checked: every file it lists is there with its size.
    Returned as the run state the Trainer resumes from, with ``kind`` and ``path``."""
    manifest_path = Path(path) / MANIFEST
    try:
        with io_watch.watching(manifest_path, "read"):
            manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:  # published only once it is written: a directory that lost it, or not hvdtrain's
        raise CorruptCheckpoint(f"{path} has no {MANIFEST}: not a complete sharded checkpoint") from None
    except OSError as error:  # the file system, not the checkpoint
        raise loading.read_failure(manifest_path, error, verified=False) from None
    except ValueError as error:
        raise CorruptCheckpoint(f"{manifest_path} is garbled: {type(error).__name__}: {error}") from None
    check_manifest(manifest, Path(path))
    return {**manifest, "path": str(path)}


# What a manifest's entries hold, by JSON type, named as its error messages name them.
_INTEGER, _TEXT, _MAPPING, _LISTING = "an integer", "a string", "an object", "a list"
_KINDS = {_INTEGER: int, _TEXT: str, _MAPPING: dict, _LISTING: list}
# Every key the rest of hvdtrain reads, by its type: checked once when the manifest is read, trusted after.
_TYPED_KEYS = {"strategy": _TEXT, "world_size": _INTEGER, "step": _INTEGER, "files": _LISTING,
               "scheduler": _MAPPING, "epoch": _INTEGER, "epoch_position": _INTEGER, "global_batch": _INTEGER,
               "precision": _MAPPING, "config": _MAPPING, "kept": _TEXT, "data_parallel": _INTEGER,
               "mesh": _LISTING}


def check_manifest(manifest: Any, path: Path) -> None:
    """CheckpointError naming the manifest and the first thing wrong with its shape: not an object, a
    key missing or of another type, an entry that is not an object with name, rank, bytes and a
    checksum, not one file per rank. The manifest is written atomically, so one that parses but has
    another shape was not written by hvdtrain: it is refused, not set aside as corrupt. Then
    CorruptCheckpoint naming a listed file that is missing or cut short."""
    where = path / MANIFEST
    remedy = f"hvdtrain never writes one like this: restore it, or move {path.name} out of the checkpoint directory"
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{where} holds {_shown(manifest)}, not an object: not an hvdtrain manifest; {remedy}")
    missing = missing_keys(manifest, _MANIFEST_KEYS)
    if missing:
        raise CheckpointError(f"{where} is not an hvdtrain manifest: missing {', '.join(missing)}; {remedy}")
    if manifest["format"] != SHARDED_FORMAT or manifest["kind"] != KIND:
        raise CheckpointError(f"{where} has format {manifest['format']} ({manifest['kind']}), this hvdtrain "
                              f"reads {SHARDED_FORMAT} ({KIND})")
    problem = _shape_problem(manifest)
    if problem:
        raise CheckpointError(f"{where}: {problem}; {remedy}")
    for entry in manifest["files"]:
        file = path / entry["name"]
        if not file.is_file():
            raise CorruptCheckpoint(f"{file} is missing (listed in {where})")
        if file.stat().st_size != entry["bytes"]:
            raise CorruptCheckpoint(f"{file} has {file.stat().st_size} bytes, {where} says {entry['bytes']}")


def _shown(value: Any) -> str:
    """A value in one line of a message, however large."""
    written = repr(value)
    return written if len(written) <= 80 else written[:77] + "..."


def _is_a(value: Any, kind: str) -> bool:
    """Whether ``value`` is of the JSON type ``kind`` names (JSON's true and false are no integers here)."""
    return isinstance(value, _KINDS[kind]) and not (kind == _INTEGER and isinstance(value, bool))


def _shape_problem(manifest: Dict[str, Any]) -> str:
    """What is wrong with a manifest's keys and file list (its format is checked before), or ''."""
    wrong = next((key for key, kind in _TYPED_KEYS.items() if key in manifest and not _is_a(manifest[key], kind)), "")
    if wrong:
        return f"{wrong} is {_shown(manifest[wrong])}, it must be {_TYPED_KEYS[wrong]}"
    size, files = manifest["world_size"], manifest["files"]
    if size < 1:
        return f"world_size is {size}, it must be at least 1"
    if len(files) != size:
        return f"world_size is {size} but files lists {len(files)}, expected one file per rank"
    return next((problem for rank, entry in enumerate(files) if (problem := _entry_problem(rank, entry, size))), "")


def _entry_problem(rank: int, entry: Any, size: int) -> str:
    """What is wrong with files[rank], the entry of rank ``rank``'s file, or ''."""
    needed = f"an entry must be an object with name, rank, bytes and a checksum ({' or '.join(checksums.ALGORITHMS)})"
    if not isinstance(entry, dict):
        return f"files[{rank}] is {_shown(entry)}, {needed}"
    lacking = [key for key in ("name", "rank", "bytes") if key not in entry]
    if lacking:
        return f"files[{rank}] has no {' and no '.join(lacking)}: {needed}"
    for key, kind in (("name", _TEXT), ("rank", _INTEGER), ("bytes", _INTEGER)):
        if not _is_a(entry[key], kind):
            return f"files[{rank}].{key} is {_shown(entry[key])}, it must be {kind}"
    if entry["name"] != shard_name(rank, size) or entry["rank"] != rank:
        return (f"files[{rank}] is {entry['name']} of rank {entry['rank']}, expected one file per rank: "
                f"{shard_name(rank, size)} of rank {rank}")
    if entry["bytes"] < 0:
        return f"files[{rank}].bytes is {entry['bytes']}, a file's size cannot be negative"
    algorithm = next((name for name in checksums.ALGORITHMS if name in entry), "")
    if not algorithm:
        return f"files[{rank}] has no checksum ({' or '.join(checksums.ALGORITHMS)}): {needed}"
    if not isinstance(entry[algorithm], str) or not entry[algorithm]:
        return f"files[{rank}].{algorithm} is {_shown(entry[algorithm])}, a checksum must be a hex string"
    return ""


def resumes_as_written(state: Dict[str, Any], strategy: str, world_size: int,
                       mesh: Sequence[int] = (), experts: int = 1) -> bool:
    """Whether each rank of this run takes back its own file of a sharded checkpoint (the same worker
    count, strategy, mesh and expert parallelism), rather than a part read at another layout through
    a tensor source (hvdtrain.checkpoint.sources).

    Args:
        state: the checkpoint's manifest.
        strategy: this run's strategy's name.
        world_size: this run's worker count.
        mesh: this run's (data, pipeline, tensor) shape; empty: a flat one. A manifest written before
            meshes had sharded checkpoints names none: a flat one.
        experts: this run's train.expert_parallel. At another E a rank holds other experts (and a
            callback's per-rank copy of them has another shape), though strategy and mesh are the same.
    """
    flat = [world_size, 1, 1]
    same_mesh = list(state.get("mesh") or flat) == (list(mesh) if mesh else flat)
    return (state["world_size"] == world_size and state["strategy"] == strategy and same_mesh
            and expert_parallel_of(state) == experts)


def check_file(path: Path, manifest: Dict[str, Any], rank: int) -> Path:
    """Rank ``rank``'s file, there and as the manifest says (size and checksum); CorruptCheckpoint
    naming the file and what differs."""
    entry = manifest["files"][rank]
    file = Path(path) / entry["name"]
    checksums.check(file, entry, str(Path(path) / MANIFEST))
    return file


def read_shard(path: Path, manifest: Dict[str, Any], rank: int, verified: bool = False) -> Dict[str, Any]:
    """Rank ``rank``'s file, checked against the manifest, tensors only.

    Args:
        path: the checkpoint's directory.
        manifest: its manifest (read_manifest).
        rank: whose file.
        verified: its checksum was checked at this start already (coordination's pre-check): only
            its size is checked now; False: size and checksum.
    """
    with io_watch.watching(Path(path) / manifest["files"][rank]["name"], "read"):
        return _read_shard(path, manifest, rank, verified)


def _read_shard(path: Path, manifest: Dict[str, Any], rank: int, verified: bool) -> Dict[str, Any]:
    entry = manifest["files"][rank]
    file = Path(path) / entry["name"]
    if not verified or not file.is_file() or file.stat().st_size != entry["bytes"]:
        check_file(Path(path), manifest, rank)  # raises naming the file (a verified one changed since)
    state = loading.load(file, verified=True)  # its checksum was checked: as written
    if not isinstance(state, dict) or state.get("format") != SHARDED_FORMAT or state.get("rank") != rank \
            or "strategy" not in state or "rng" not in state:
        raise CheckpointError(f"{file} is not rank {rank}'s shard of an hvdtrain sharded checkpoint")
    return state


def newest_in(directory: Path) -> Optional[Path]:
    """The newest sharded checkpoint directory in ``directory`` (complete or not), for hints."""
    found = sorted(p for p in Path(directory).iterdir() if DIRECTORY.match(p.name) and p.is_dir())
    return found[-1] if found else None

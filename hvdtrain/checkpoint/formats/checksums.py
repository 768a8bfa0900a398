"""Checksums of checkpoint files: computed while a file is written, checked before it is trusted.

New files are hashed with xxhash's xxh3_128 (27.7 GiB/s on this machine against sha256's 1.86: a
checkpoint is verified at every start at a fraction of the cost of reading it). A record of a file
names its algorithm by its key (``{"bytes": ..., "xxh3_128": "..."}``), so manifests written before
(``"sha256"``) are still checked with theirs.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Dict, Mapping, Tuple

import xxhash

from hvdtrain.checkpoint import CorruptCheckpoint
from hvdtrain.common import io_watch

ALGORITHM = "xxh3_128"
# Every algorithm a record may name, newest first: a record's key is its algorithm.
ALGORITHMS: Dict[str, Callable[[], Any]] = {ALGORITHM: xxhash.xxh3_128, "sha256": hashlib.sha256}
_BLOCK = 1 << 22


class HashingWriter:
    """A file that hashes what is written through it (torch.save writes front to back); ``size``
    counts the bytes."""

    def __init__(self, handle) -> None:
        self.handle, self.hash, self.size = handle, ALGORITHMS[ALGORITHM](), 0

    def write(self, data) -> int:
        self.hash.update(data)
        self.size += len(data)
        return self.handle.write(data)

    def flush(self) -> None:
        self.handle.flush()

    def record(self, path: Path) -> Dict[str, Any]:
        """What a manifest or sidecar holds of the file just written through this writer (flushed
        and closed): its bytes and checksum; hashed again from the disk if the sizes disagree (a
        writer that seeked back)."""
        size = Path(path).stat().st_size
        digest = self.hash.hexdigest() if size == self.size else of_file(path, ALGORITHM)
        return {"bytes": size, ALGORITHM: digest}


def of_file(path: Path, algorithm: str = ALGORITHM) -> str:
    """The hex digest of the file at ``path``, read in blocks (each block progress for the stall
    watchdog: a checksum of a large file on a slow disk is slow, one on a hung mount is stuck)."""
    digest = ALGORITHMS[algorithm]()
    with io_watch.watching(path, "read") as activity, open(path, "rb", buffering=0) as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
            activity.progress(len(block))
    return digest.hexdigest()


def recorded(record: Mapping[str, Any]) -> Tuple[str, str]:
    """(algorithm, digest) a record holds, or ("", "") when it names none this hvdtrain knows."""
    for algorithm in ALGORITHMS:
        if isinstance(record.get(algorithm), str) and record[algorithm]:
            return algorithm, record[algorithm]
    return "", ""


def check(path: Path, record: Mapping[str, Any], where: str) -> None:
    """CorruptCheckpoint naming the file and what failed, unless the file at ``path`` has the size
    and checksum ``record`` (from ``where``: a manifest, a sidecar) says.

    Args:
        path: the file checked.
        record: its bytes and checksum, as HashingWriter.record gave them.
        where: what holds the record, named in the error.
    """
    path = Path(path)
    if not path.is_file():
        raise CorruptCheckpoint(f"{path} is missing (listed in {where})")
    size = os.stat(path).st_size
    if size != record["bytes"]:
        raise CorruptCheckpoint(f"{path} has {size} bytes, {where} says {record['bytes']}: it is cut short or "
                                f"from another checkpoint")
    algorithm, expected = recorded(record)
    actual = of_file(path, algorithm)
    if actual != expected:
        raise CorruptCheckpoint(f"{path} does not match {where}: its {algorithm} is {actual}, {expected} was "
                                f"written: it is corrupt (changed on disk since it was written)")

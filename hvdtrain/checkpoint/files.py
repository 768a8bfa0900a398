"""What both checkpoint formats share: the error they raise, the full format's version, and
writing a file so that a kill at any moment leaves either the old content or the new one."""
from __future__ import annotations

import os
from pathlib import Path

FORMAT_VERSION = 1  # of the full format (one file); hvdtrain.checkpoint.sharded_format has its own


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message says which file and why."""


def fsync_directory(directory: Path) -> None:
    """Make a rename durable: the directory entry must reach the disk too."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, write) -> None:
    """``write(handle)`` into a temporary file, flushed to disk, then renamed to ``path``."""
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
    fsync_directory(path.parent)

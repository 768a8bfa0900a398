"""Files that appear whole or not at all: a kill at any moment leaves the old content or the new.

Everything hvdtrain writes that a later run or tool reads (checkpoints, their manifests and
``latest`` pointer, the exported model, a run's config, benchmark results) goes through here; each
write is watched while it runs, its bytes counted, flush and rename included (hvdtrain.common.io_watch).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

from hvdtrain.common import io_watch


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename in it), to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_directory(directory: Path) -> None:
    """Make a rename durable: the directory entry must reach the disk too."""
    fsync_path(directory)


@contextmanager
def atomic_path(path: Path, before_rename: Optional[Callable[[], None]] = None) -> Iterator[Path]:
    """A temporary path beside ``path`` for the caller to write (for writers that take a path);
    once the block ends without an error it is flushed to disk and renamed to ``path``.

    ``before_rename``: called right before the rename, the one irreversible step; an error it
    raises leaves ``path`` as it was (a checkpoint directory's lease is checked there: fencing)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield temporary
        fsync_path(temporary)
        if before_rename is not None:
            before_rename()
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    fsync_directory(path.parent)


def write_atomically(path: Path, write: Callable[[BinaryIO], object],
                     before_rename: Optional[Callable[[], None]] = None) -> None:
    """``write(handle)`` into a temporary file, flushed to disk, then renamed to ``path``
    (``before_rename``: see atomic_path)."""
    with io_watch.watching(path, "write") as activity, atomic_path(path, before_rename) as temporary:
        with open(temporary, "wb") as handle:
            write(activity.counting(handle))


def write_text_atomically(path: Path, text: str) -> None:
    write_atomically(path, lambda handle: handle.write(text.encode("utf-8")))

"""train.compile resumes warm on any host: what Inductor compiled, saved beside the checkpoints, signed.

torch keeps what it compiles in a cache directory of the host (/tmp/torchinductor_<user> unless
TORCHINDUCTOR_CACHE_DIR says otherwise): a restart on the same host compiles from it, a restart on
other hosts (a requeued SLURM job, an elastic replacement, a node-local /tmp wiped between jobs)
compiles again from nothing, which takes minutes for a large model. torch.compiler's portable
cache (``save_cache_artifacts``) packs what this process compiled into bytes that
``load_cache_artifacts`` puts into any host's cache. Rank 0 writes them into the checkpoint
directory, atomically, after the first step and at the end of every fit() when they grew; every
rank loads them before its first compile. Artifacts from another CPU or torch version miss and
compile as before (torch's cache key holds both); an unreadable file is named and skipped.

Why signed: Inductor's cache entries are pickles, unpickled and run when loaded, so the file is
code, and a checkpoint directory is often shared (a project's scratch space). Everything else read
from it is tensors and plain values (``torch.load(weights_only=True)``). So the file carries an
HMAC-SHA256 of its bytes under a key only this user can read (``key_path``), and it is loaded only
when that HMAC verifies: written by this user's runs, unchanged since. Anything else (unsigned,
another key, changed) is named in one warning and not loaded; compiling from nothing is always
right, and the file is replaced after the first step. The key lives in the home directory, so hosts
that do not share one hold different keys: point HVDTRAIN_COMPILE_CACHE_KEY_FILE at one key on a
shared path to share it.
"""
from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import stat
import tempfile
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import torch

from hvdtrain.common.atomic import write_atomically

CACHE_FILE = "compile-cache.bin"
KEY_FILE_VARIABLE = "HVDTRAIN_COMPILE_CACHE_KEY_FILE"
KEY_BYTES = 32
TAG = b"hvdtrain-compile-cache/"  # every signed format's first line starts so
FORMAT = TAG + b"1"
# The file's first line: the format, which key signed it (an id that reveals nothing of the key, so
# that "another key" and "changed bytes" can be told apart), and the HMAC of the bytes after the line.
HEADER = re.compile(re.escape(FORMAT) + rb" key=(?P<key>[0-9a-f]{16}) hmac-sha256=(?P<mac>[0-9a-f]{64})")
NOT_LOADED = "compiling from nothing instead (always right); the file is replaced after the first step"


class UnusableKey(Exception):
    """The key file cannot be used; the message says why and what to do, on one line."""


class NotLoaded(Exception):
    """The cache file is not this user's signed file; the message says why, on one line."""


def key_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where this user's key is: $HVDTRAIN_COMPILE_CACHE_KEY_FILE, else the user's cache directory."""
    if environ.get(KEY_FILE_VARIABLE):
        return Path(environ[KEY_FILE_VARIABLE]).expanduser()
    cache_home = environ.get("XDG_CACHE_HOME", "")
    # The XDG spec: an unset, empty or relative XDG_CACHE_HOME means ~/.cache.
    base = Path(cache_home) if os.path.isabs(cache_home) else Path.home() / ".cache"
    return base / "hvdtrain" / "compile-cache.key"


def read_key(path: Path) -> bytes:
    """The key in ``path``, refused unless only this user can read it (FileNotFoundError if absent)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        # Checked on the open file, not the path: what is read is what was checked.
        check_key_file(path, os.fstat(fd))
        key = os.read(fd, KEY_BYTES + 1)
    finally:
        os.close(fd)
    if len(key) != KEY_BYTES:
        raise UnusableKey(f"key file {path} holds {len(key)} bytes, not {KEY_BYTES}: remove it "
                          "(a new key is made at the next run)")
    return key


def check_key_file(path: Path, status: os.stat_result) -> None:
    """A key others can read (or replace) signs nothing: anyone could sign code this user then runs."""
    if not stat.S_ISREG(status.st_mode):
        raise UnusableKey(f"key file {path} is not a regular file: remove it (a new key is made at the next run)")
    if status.st_uid != os.geteuid():
        raise UnusableKey(f"key file {path} belongs to uid {status.st_uid}, not to you (uid {os.geteuid()}): "
                          f"remove it, or set {KEY_FILE_VARIABLE} to a key of your own")
    if status.st_mode & 0o077:
        raise UnusableKey(f"key file {path} is open to group or others (mode "
                          f"{stat.S_IMODE(status.st_mode):04o}): run chmod 600 {path}")


def create_key(path: Path) -> bytes:
    """A new random key at ``path``, unless another process (on any host sharing the directory)
    made one first: then that one. A key written whole, then linked to its name: ``os.link``
    never replaces, so exactly one process's key gets the name, and only a whole one."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 0600
    try:
        try:
            os.write(fd, os.urandom(KEY_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(temporary, path)
        except FileExistsError:
            pass  # another process's key got the name first: every process uses that one
    finally:
        os.unlink(temporary)
    return read_key(path)


def read_or_create_key(path: Path) -> bytes:
    try:
        return read_key(path)
    except FileNotFoundError:
        return create_key(path)


def key_id(key: bytes) -> str:
    """Which key signed a file, named without revealing it (an HMAC of a constant under the key)."""
    return hmac.new(key, b"hvdtrain compile-cache key id", hashlib.sha256).hexdigest()[:16]


def signed(data: bytes, key: bytes) -> bytes:
    """The file's content: the header line, then the artifacts' bytes."""
    mac = hmac.new(key, data, hashlib.sha256).hexdigest()
    return FORMAT + f" key={key_id(key)} hmac-sha256={mac}\n".encode("ascii") + data


def verified(content: bytes, key: bytes) -> bytes:
    """The artifacts' bytes of a file signed with ``key`` and unchanged since; else NotLoaded, saying why."""
    header, newline, data = content.partition(b"\n")
    if not header.startswith(TAG) or not newline:
        raise NotLoaded("it is unsigned (written by an hvdtrain before signed compile caches, or not by hvdtrain)")
    match = HEADER.fullmatch(header)
    if match is None:
        raise NotLoaded(f"its header is not this hvdtrain's format {FORMAT.decode()} "
                        "(written by another version, or changed)")
    if match["key"].decode() != key_id(key):
        raise NotLoaded("it is signed with another key (another user's, or written on a host that does not "
                        f"share this home directory: set {KEY_FILE_VARIABLE} to one key on a shared path)")
    if not hmac.compare_digest(match["mac"].decode(), hmac.new(key, data, hashlib.sha256).hexdigest()):
        raise NotLoaded("its bytes do not match its signature (changed since it was written)")
    return data


def artifact_count(info: Any) -> int:
    """How many compiled artifacts torch's CacheInfo lists (its kinds: inductor, aot_autograd, ...)."""
    return sum(len(keys) for keys in getattr(info, "artifacts", {}).values())


class NotOwner(Exception):
    """``before_publish`` refused: this run no longer owns the checkpoint directory."""


class CompileCache:
    """The checkpoint directory's compile cache: loaded by every rank, written by ``is_root``.

    Args:
        directory: the checkpoint directory (None: no cache).
        is_root: this rank writes the file.
        log: where its warnings and counts go.
        before_publish: called right before the file is renamed into place; an exception from it
            means this run no longer owns the directory: the file is left as it was (fencing).
    """

    def __init__(self, directory: Optional[str], is_root: bool, log: logging.Logger,
                 before_publish: Optional[Callable[[], None]] = None) -> None:
        self.path = Path(directory) / CACHE_FILE if directory else None
        self.is_root, self.log = is_root, log
        self.before_publish = before_publish
        self.written = 0  # artifacts in the file, as loaded or last written
        self.saved_after_first_step = False

    @cached_property
    def key(self) -> Optional[bytes]:
        """This user's key, read or made on first use; None (warned once) when it cannot be used."""
        path = key_path()
        try:
            return read_or_create_key(path)
        except UnusableKey as error:
            self.log.warning(f"compile cache not used: {error}")
        except OSError as error:
            self.log.warning(f"compile cache not used: key file {path} cannot be read or made "
                             f"({type(error).__name__}: {error}); set {KEY_FILE_VARIABLE} to a path of yours")
        return None

    def load(self) -> int:
        """Every rank, before the first compile: the file's artifacts into this host's cache, when signed."""
        if self.path is None or not self.path.is_file() or self.key is None:
            return 0
        try:
            data = verified(self.path.read_bytes(), self.key)
            info = torch.compiler.load_cache_artifacts(data)
        except NotLoaded as why:
            self.log.warning(f"compile cache {self.path} not loaded: {why}; {NOT_LOADED}")
            return 0
        except Exception as error:  # unreadable, torn or foreign artifacts
            self.log.warning(f"compile cache {self.path} not loaded ({type(error).__name__}: {error}); {NOT_LOADED}")
            return 0
        self.written = artifact_count(info)
        self.log.info(f"compile cache: {self.written} compiled artifacts loaded from {self.path}")
        return self.written

    def save(self) -> None:
        """Rank 0: what this process compiled, into the file, when it holds more than the file."""
        if self.path is None or not self.is_root:
            return
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data, info = saved
        count = artifact_count(info)
        if count <= self.written or self.key is None:
            return
        content = signed(data, self.key)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            write_atomically(self.path, lambda handle: handle.write(content), before_rename=self.fenced)
        except NotOwner as error:
            self.log.warning(f"compile cache not saved to {self.path}: this run no longer owns the checkpoint "
                             f"directory ({error}); training goes on")
            return
        self.written = count
        self.log.info(f"compile cache: {count} compiled artifacts saved to {self.path} (a restart loads them)")

    def fenced(self) -> None:
        """``before_publish``, its refusal told apart from a failed write (which stops the run)."""
        if self.before_publish is None:
            return
        try:
            self.before_publish()
        except Exception as error:
            raise NotOwner(f"{type(error).__name__}: {error}") from error

    def after_first_step(self) -> None:
        if not self.saved_after_first_step:
            self.saved_after_first_step = True
            self.save()

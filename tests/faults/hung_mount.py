"""A mount under a path whose file calls stop on the test's order: the file system of a bad day
(an NFS server gone quiet, a Lustre OST that stopped answering), on one machine.

    with HungMount(tmp_path / "backing") as mount:          # mount.path: where the clients look
        mount.hang(ops={"utime", "open"}, names="owner.json")  # from now on such calls wait
        client = subprocess.Popen([..., str(mount.path / "ckpt")])
        mount.wait_blocked(timeout=30)   # [Call(op='utimens', path='/ckpt/owner.json', pid=..., ...)]
        mount.release()                  # the stopped calls go on, and every later one passes

The mount passes every call through to the backing directory, in a FUSE server process of its own
(fuse_server.py). A stopped call waits in the kernel, as on a hung network file system: Python's
calls, C++ file streams (torch.save) and the page faults of a memory-mapped file (torch.load with
mmap=True) all wait alike, and only SIGKILL (or the exit of the caller's process) ends the wait,
at once. ``fail`` makes calls fail with an errno instead (EIO, ENOSPC, ESTALE).

Operation names are libfuse's (rules.OPERATIONS): a path lookup is ``getattr``, os.utime is
``utimens``; aliases: utime, stat, lookup, setattr. What cannot be stopped: the release of a closed
file (close() waits on its ``flush``, which can be), file contents the kernel still caches (pages
read or written, by any process, since the file was last opened) and anything not under the mount.

As on a network file system, a stopped call that changes a directory's names (create, mkdir, mknod,
symlink, link, unlink, rmdir, rename), or a lookup of a name the kernel does not know yet, holds
that directory's lock in the kernel: other creates, removals and renames in that directory, and
lookups of new names, then wait on the lock, on this machine, without reaching the server (they are
not among ``blocked()``). To spare a file's neighbours, stop the calls on the file itself (open,
read, write, utimens, fsync), or put the neighbours in another directory.

Measured here (Debian 12, 2 cores, kernel 6.18, libfuse 3.14, mfusepy 3.1.1, backing on ext4;
three runs): mounting takes 0.2-0.35 s (mostly the server's Python start), unmounting 0.03-0.1 s.
A 64 MiB file in 1 MiB calls is written at 160-420 MB/s and read at 290-550 MB/s through the mount,
against 750-1500 MB/s and 4.5-7.5 GB/s (page cache) on the backing directory; 400-1000 small
files created a second, 1400-2200 stats. Tests use files of kilobytes to a few MiB.

Needs Linux, root (mounting, and unmounting without the server's help), /dev/fuse, libfuse3 and
mfusepy (scripts/setup.sh installs both); without them a test that uses it is skipped, saying why.
"""
import contextlib
import ctypes
import ctypes.util
import functools
import importlib.util
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterable, List, NamedTuple, Optional, Union

from tests.faults.channel import Channel, ChannelClosed
from tests.faults.rules import FaultRule

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT = 20.0  # seconds for the server to mount
REQUEST_TIMEOUT = 10.0  # for an answer on the control channel
STOP_TIMEOUT = 3.0  # for the server to end once released and unmounted, before it is killed
POLL_SECONDS = 0.02
MNT_DETACH = 2
CAP_SYS_ADMIN = 21

Names = Union[str, Iterable[str], None]


class Call(NamedTuple):
    """A file call the mount saw: its operation, path in the mount (``/ckpt/owner.json``), the
    process and thread that made it, and the second path of a rename or link."""
    op: str
    path: str
    pid: int
    tid: int
    target: Optional[str] = None


@functools.lru_cache(maxsize=None)
def fuse_missing() -> Optional[str]:
    """Why a hung mount cannot be made on this machine, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "a hung mount is a Linux FUSE file system"
    if os.geteuid() != 0:
        return "a hung mount needs root (it mounts, and unmounts with mount(2) whatever the server does)"
    if not _has_capability(CAP_SYS_ADMIN):
        return "no CAP_SYS_ADMIN: this container may not mount"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as error:
        return f"cannot open /dev/fuse ({error.strerror}): a container without the FUSE device?"
    if ctypes.util.find_library("fuse3") is None:
        return "no libfuse3 (apt-get install fuse3; scripts/setup.sh installs it when run as root)"
    if importlib.util.find_spec("mfusepy") is None:
        return "mfusepy is not installed (pip install -e '.[test]')"
    return None


def require_fuse() -> None:
    """Skips the calling test, saying why, where a hung mount cannot be made."""
    reason = fuse_missing()
    if reason:
        import pytest  # only here: the server process imports this package too, and needs no pytest
        pytest.skip(reason)


def is_mounted(path: Path) -> bool:
    """Whether something is mounted on ``path``, read from the mount table: a stat of the path
    itself would wait on a hung mount."""
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as table:
        for line in table:
            mount_point = re.sub(r"\\([0-7]{3})", lambda code: chr(int(code.group(1), 8)), line.split()[4])
            if mount_point == target:  # (the table writes a space as \040)
                return True
    return False


def detach(path: Path) -> None:
    """Lazily unmounts ``path``: gone from the tree at once, even while calls on it wait."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(os.fsencode(os.path.abspath(path)), MNT_DETACH)


def _has_capability(bit: int) -> bool:
    with open("/proc/self/status") as status:
        effective = next(line.split()[1] for line in status if line.startswith("CapEff:"))
    return bool(int(effective, 16) >> bit & 1)


class HungMount:
    """A passthrough FUSE mount of ``backing`` at ``mountpoint`` (default: beside ``backing``, named
    ``<backing>-mount``), whose calls stop or fail as told; a context manager. Leaving it releases
    every stopped call and unmounts, also when the test failed or a client is still waiting; a
    server that does not end then is killed, which fails whatever still waits with ENOTCONN."""

    def __init__(self, backing: Union[str, Path], mountpoint: Union[str, Path, None] = None,
                 max_threads: int = 64):
        self.backing = Path(backing).absolute()
        default = self.backing.with_name(self.backing.name + "-mount")
        self.path = Path(mountpoint).absolute() if mountpoint else default
        self.log = self.path.with_name(self.path.name + ".log")  # the server's output, for failures
        self.max_threads = max_threads  # libfuse threads: each stopped call holds one
        self.mount_seconds: Optional[float] = None
        self.unmount_seconds: Optional[float] = None
        self._server: Optional[subprocess.Popen] = None
        self._channel: Optional[Channel] = None
        self._rule: Optional[FaultRule] = None
        self._talking = threading.Lock()  # one request and its answer at a time on the channel

    def __enter__(self) -> "HungMount":
        require_fuse()
        self.open()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def open(self) -> None:
        """Starts the server and waits until the mount answers."""
        started = time.monotonic()
        self.backing.mkdir(parents=True, exist_ok=True)
        if is_mounted(self.path):  # left by an earlier run that was killed
            detach(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        with open(self.log, "wb") as log:
            self._server = subprocess.Popen(
                [sys.executable, "-m", "tests.faults.fuse_server", str(self.backing), str(self.path),
                 "--control-fd", str(theirs.fileno()), "--max-threads", str(self.max_threads)],
                cwd=REPO, env=env, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)  # a test's Ctrl-C must not end it first
        theirs.close()
        self._channel = Channel(ours)
        try:
            while not self._request("status", timeout=START_TIMEOUT)["ready"]:
                if time.monotonic() - started > START_TIMEOUT:
                    raise RuntimeError(f"the hung mount at {self.path} was not up in {START_TIMEOUT} s")
                time.sleep(POLL_SECONDS)
        except BaseException:
            self.close()
            raise
        self.mount_seconds = time.monotonic() - started

    def hang(self, ops: Names = None, names: Names = None, after: int = 0) -> None:
        """From now on, calls of ``ops`` (None: all) on paths matching ``names`` (globs; None: all)
        wait until ``release``, once ``after`` of them went through. Replaces the rule before;
        calls already waiting keep waiting."""
        self._set_rule(FaultRule.make(ops, names, after))

    def fail(self, error: int, ops: Names = None, names: Names = None, after: int = 0) -> None:
        """From now on, calls fail with an errno instead of waiting, until ``release``.

        Args:
            error: the errno they fail with (errno.ENOSPC, EIO, ESTALE).
            ops: the operations (or aliases) that fail; None: all.
            names: globs of the paths that fail; None: all.
            after: how many such calls go through first.
        """
        self._set_rule(FaultRule.make(ops, names, after, error))

    def release(self) -> None:
        """Lets every stopped call go on, and every later call pass, until the next rule."""
        self._rule = None
        self._request("release")

    def blocked(self) -> List[Call]:
        """The calls waiting now."""
        return [Call(**call) for call in self._request("status")["waiting"]]

    def wait_blocked(self, timeout: float = 30.0, count: int = 1) -> List[Call]:
        """The calls waiting, as soon as at least ``count`` are; raises TimeoutError after
        ``timeout`` seconds, naming the rule and the last calls seen."""
        deadline = time.monotonic() + timeout
        while True:
            waiting = self.blocked()
            if len(waiting) >= count:
                return waiting
            if time.monotonic() > deadline:
                recent = "\n  ".join(map(str, self.calls()[-15:])) or "none"
                raise TimeoutError(f"{len(waiting)} of {count} call(s) stopped within {timeout} s under "
                                   f"{self._rule}; waiting: {waiting}; last calls seen:\n  {recent}")
            time.sleep(POLL_SECONDS)

    def calls(self, forget: bool = False) -> List[Call]:
        """Every call seen since the mount (or since the last ``calls(forget=True)``), oldest first."""
        return [Call(**call) for call in self._request("calls", forget=forget)["calls"]]

    def close(self) -> None:
        """Releases, unmounts and ends the server, whatever state they are in; idempotent."""
        if self._server is None:
            return
        started = time.monotonic()
        try:
            with contextlib.suppress(ChannelClosed, OSError, RuntimeError):
                self._request("release", timeout=2.0)
            self._channel.close()  # the server's cue to release everything, unmount and end
            detach(self.path)  # without waiting for the server to do it
            try:
                self._server.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                # Something still holds a file of the detached mount, or the server is wedged:
                # killing it aborts the connection, so nothing can wait on it any longer.
                self._server.kill()
                self._server.wait(STOP_TIMEOUT)
        finally:
            self._server = None
            if is_mounted(self.path):
                detach(self.path)
        self.unmount_seconds = time.monotonic() - started
        if is_mounted(self.path):
            raise RuntimeError(f"{self.path} is still mounted after the hung mount's teardown")
        with contextlib.suppress(OSError):
            self.path.rmdir()

    def _set_rule(self, rule: FaultRule) -> None:
        self._request("rule", rule=rule.to_message())
        self._rule = rule

    def _request(self, command: str, timeout: float = REQUEST_TIMEOUT, **fields) -> dict:
        if self._server is None:
            raise RuntimeError("the hung mount is not open")
        try:
            with self._talking:
                self._channel.send(dict(fields, command=command))
                reply = self._channel.receive(timeout)
        except (ChannelClosed, OSError) as error:
            raise RuntimeError(f"the hung mount's server did not answer {command!r} ({error}); "
                               f"exit code {self._server.poll()}; its log:\n{self._log_tail()}") from error
        if not reply.get("ok"):
            raise RuntimeError(f"the hung mount's server refused {command!r}: {reply.get('error')}")
        return reply

    def _log_tail(self, characters: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-characters:]
        return "(no log)"

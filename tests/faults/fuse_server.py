"""The process behind a HungMount: a FUSE file system passing every call through to a backing
directory, each call first asking the gate (gate.py) whether it may go on, wait, or fail.

    python -m tests.faults.fuse_server BACKING MOUNTPOINT --control-fd N

Started by HungMount (hung_mount.py), which holds the other end of the control channel (fd N). A
stopped call waits here, in the thread libfuse runs it on, so the caller waits in the kernel: for
it the file system simply does not answer, whether the call came from Python, from C++ or from a
page fault. Gives up on a stopped call only when its caller is dying (SIGKILL, exit of its process),
so that a killed client dies at once instead of staying in D state until the release.

When the control channel closes (the test process ended, however), everything stopped is released
and the mount unmounts itself: a test that dies leaves no mount behind.
"""
import argparse
import ctypes
import errno
import logging
import os
import socket
import sys
import threading
import time

# mfusepy (setup.cfg's test extra): fusepy's maintained fork, ctypes over the system's libfuse3, a pure
# wheel. Not fusepy (unmaintained since 2018, libfuse 2 only), nor pyfuse3 (compiled against
# libfuse3-dev with pkg-config, and async on trio: more to install and to read for a passthrough this
# small). Only this process imports it: the test process needs neither it nor libfuse.
os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")  # not a libfuse 2 that happens to be installed too
import mfusepy  # noqa: E402

from tests.faults.channel import Channel, ChannelClosed  # noqa: E402
from tests.faults.gate import Gate  # noqa: E402
from tests.faults.rules import FaultRule  # noqa: E402

MNT_DETACH = 2
UTIME_NOW, UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2


class Passthrough(mfusepy.Operations):
    """Every call done on the backing directory, after the gate let it through. Files are kept
    open as file descriptors of the backing files (the fh of each call)."""

    use_ns = True  # times in integer nanoseconds, as os.stat gives them

    def __init__(self, backing: str, gate: Gate):
        self.backing = backing
        self.gate = gate

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _enter(self, op: str, *paths: str) -> None:
        self.gate.enter(op, paths, tid=mfusepy.fuse_get_context()[2])

    def init(self, path):
        self.gate.ready.set()

    def getattr(self, path, fh=None):
        self._enter("getattr", path)
        st = os.fstat(fh) if fh is not None else os.lstat(self._real(path))
        attributes = {key: getattr(st, key) for key in (
            "st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_rdev")}
        attributes.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attributes

    def access(self, path, amode):
        self._enter("access", path)
        if not os.access(self._real(path), amode):
            raise mfusepy.FuseOSError(errno.EACCES)
        return 0

    def readlink(self, path):
        self._enter("readlink", path)
        return os.readlink(self._real(path))

    def mknod(self, path, mode, dev):
        self._enter("mknod", path)
        os.mknod(self._real(path), mode, dev)
        return 0

    def mkdir(self, path, mode):
        self._enter("mkdir", path)
        os.mkdir(self._real(path), mode)
        return 0

    def unlink(self, path):
        self._enter("unlink", path)
        os.unlink(self._real(path))
        return 0

    def rmdir(self, path):
        self._enter("rmdir", path)
        os.rmdir(self._real(path))
        return 0

    def symlink(self, target, source):  # mfusepy's order: the new link's path, then what it holds
        self._enter("symlink", target)
        os.symlink(source, self._real(target))
        return 0

    def rename(self, old, new):
        self._enter("rename", old, new)
        os.rename(self._real(old), self._real(new))
        return 0

    def link(self, target, source):  # the new name, then the existing file
        self._enter("link", source, target)
        os.link(self._real(source), self._real(target), follow_symlinks=False)
        return 0

    def chmod(self, path, mode):
        self._enter("chmod", path)
        os.chmod(self._real(path), mode)
        return 0

    def chown(self, path, uid, gid):
        self._enter("chown", path)
        os.lchown(self._real(path), uid, gid)
        return 0

    def truncate(self, path, length, fh=None):
        self._enter("truncate", path)
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._real(path), length)
        return 0

    def utimens(self, path, times=None):
        self._enter("utimens", path)
        real = self._real(path)
        if times is None:
            os.utime(real, follow_symlinks=False)
        else:
            st = os.lstat(real)
            os.utime(real, ns=(_time(times[0], st.st_atime_ns), _time(times[1], st.st_mtime_ns)),
                     follow_symlinks=False)
        return 0

    def open(self, path, flags):
        self._enter("open", path)
        return os.open(self._real(path), flags)

    def create(self, path, mode, flags):
        self._enter("create", path)
        return os.open(self._real(path), flags | os.O_CREAT, mode)

    def read(self, path, size, offset, fh):
        self._enter("read", path)
        return os.pread(fh, size, offset)

    def write(self, path, data, offset, fh):
        self._enter("write", path)
        return os.pwrite(fh, data, offset)

    def statfs(self, path):
        self._enter("statfs", path)
        st = os.statvfs(self._real(path))
        return {key: getattr(st, key) for key in (
            "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail",
            "f_flag", "f_namemax")}

    def flush(self, path, fh):
        self._enter("flush", path)
        os.close(os.dup(fh))  # what close() of the backing file would report, without closing it
        return 0

    def release(self, path, fh):
        os.close(fh)
        return 0

    def fsync(self, path, datasync, fh):
        self._enter("fsync", path)
        (os.fdatasync if datasync else os.fsync)(fh)
        return 0

    def opendir(self, path):
        self._enter("opendir", path)
        return 0

    def readdir(self, path, fh):
        self._enter("readdir", path)
        return [".", ".."] + os.listdir(self._real(path))

    def fsyncdir(self, path, datasync, fh):
        self._enter("fsyncdir", path)
        fd = os.open(self._real(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return 0


def _time(value: int, current: int) -> int:
    """A time libfuse passed to utimens, in ns: libfuse sends "now" and "leave it" as the nanoseconds
    UTIME_NOW and UTIME_OMIT of second 0 (what os.utime(path) and os.utime(path, ns=...) send)."""
    if value == UTIME_NOW:
        return time.time_ns()
    return current if value == UTIME_OMIT else value


class RenameFlagsRefused(mfusepy.FUSE):
    """mfusepy's FUSE, except that a rename with flags (renameat2's RENAME_NOREPLACE or EXCHANGE)
    fails with EINVAL, as on a file system without them, instead of being done as a plain rename."""

    def rename_fuse_3(self, old, new, flags):
        return -errno.EINVAL if flags else super().rename_fuse_3(old, new, flags)


def serve_control(channel: Channel, gate: Gate, mountpoint: str) -> None:
    """Answers the test's requests until the channel closes; then lets everything go and unmounts."""
    try:
        while True:
            request = channel.receive(timeout=None)
            command, reply = request["command"], {"ok": True}
            if command == "rule":
                gate.set_rule(FaultRule.from_message(request["rule"]))
            elif command == "release":
                gate.release()
            elif command == "status":
                reply.update(ready=gate.ready.is_set(), waiting=gate.waiting())
            elif command == "calls":
                reply.update(calls=gate.seen(forget=request.get("forget", False)))
            else:
                reply = {"ok": False, "error": f"unknown command {command!r}"}
            channel.send(reply)
    except (ChannelClosed, OSError):
        pass
    gate.release()
    # The FUSE loop ends once the kernel lets go of the file system: at once after a lazy unmount,
    # or when the last client holding a file of it closes it.
    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(mountpoint.encode(), MNT_DETACH)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("backing")
    parser.add_argument("mountpoint")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--max-threads", type=int, default=64)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    gate = Gate()
    channel = Channel(socket.socket(fileno=args.control_fd))
    threading.Thread(target=serve_control, args=(channel, gate, args.mountpoint), daemon=True,
                     name="control").start()
    RenameFlagsRefused(
        Passthrough(os.path.abspath(args.backing), gate), args.mountpoint, foreground=True,
        fsname="hvdtrain-hung-mount", subtype="hung",
        # Every call reaches the server: no attributes, names or absent names cached by the kernel
        # (a stat that the cache answered could not be stopped). File contents are cached only
        # while a file is open (libfuse drops them at each open), so mmap's page faults reach it.
        attr_timeout=0, entry_timeout=0, negative_timeout=0,
        # Each stopped call holds one of libfuse's threads: with all of them stopped, every other call
        # waits for one too. Idle ones are kept, up to as many (libfuse 3.14 warns when left unset).
        max_threads=args.max_threads, max_idle_threads=args.max_threads,
        # As a local file system does: the kernel checks permissions, any user may use the mount,
        # and a file removed while open is gone at once (no .fuse_hidden copies to see in listings).
        default_permissions=True, allow_other=True, hard_remove=True)


if __name__ == "__main__":
    main()

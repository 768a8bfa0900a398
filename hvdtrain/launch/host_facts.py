"""What one host can tell about itself, for ``hvdtrain doctor``.

This file is sent as a script to each host (``ssh HOST PYTHON - ARGS`` with this source on
stdin), so it imports nothing outside the standard library and never imports torch: versions
come from the installed packages' metadata. It prints one JSON object.

    python host_facts.py facts '{"checkpoint_dir": "/shared/ckpt", "token": "abc"}'
    python host_facts.py tokens '{"checkpoint_dir": "/shared/ckpt", "token": "abc"}'
    python host_facts.py cleanup '{"checkpoint_dir": "/shared/ckpt", "token": "abc"}'
    python host_facts.py lock_hold '{"checkpoint_dir": "/shared/ckpt", "token": "abc"}'   # on one host
    python host_facts.py lock_try '{"checkpoint_dir": "/shared/ckpt", "token": "abc"}'    # on another, at once

The lock probe: one host takes a flock on a file in the directory and creates another with O_EXCL,
then holds both while a second host tries the same (they meet through marker files in the
directory). The second host refused the flock: coherent; granted it: node-local; ENOSYS or
EOPNOTSUPP: no flock. Its O_EXCL create must fail: hvdtrain's run lock (a lease) relies on it.

The clock probe: a file created in the checkpoint directory gets its time from the clock that sets
the directory's file times (the server's on NFS, this host's on Lustre, GPFS and local disks); that
time against time.time() just before and after the create is this host's clock offset.
"""
import errno
import json
import os
import re
import socket
import sys
import time
from importlib import metadata

PACKAGES = ("torch", "horovod", "mpi4py", "hvdtrain")
TOKEN_PREFIX = ".hvdtrain-doctor-"
LOCK_WAIT = 12  # seconds each side of the lock probe waits for the other's marker
NO_FLOCK = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK, errno.EINVAL)
CLOCK_SAMPLES = 3  # the create with the shortest round trip bounds the offset best (as NTP picks)


def versions():
    found = {"python": "%d.%d.%d" % sys.version_info[:3]}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def gpu_count():
    """NVIDIA GPUs a job step on this host can use (no CUDA import: this runs on login nodes too):
    the lines of ``nvidia-smi -L`` when it is installed (it lists only the GPUs of this cgroup when
    SLURM confines the devices), else the driver's /proc entries, else 0 (no GPU visible)."""
    import shutil
    import subprocess

    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
        except subprocess.TimeoutExpired:
            done = None
        if done is not None and done.returncode == 0:
            return sum(1 for line in done.stdout.splitlines() if line.strip().startswith("GPU "))
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def interfaces():
    """Interfaces that are up and have an IPv4 address (what MPI and Gloo can use)."""
    names = []
    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/operstate") as state:
                up = state.read().strip() in ("up", "unknown")
        except OSError:
            up = False
        if up:
            names.append(name)
    return sorted(names)


def write_token(directory, token):
    """Create this host's token file; say why not when it cannot."""
    if not directory:
        return {"checked": False}
    path = os.path.join(directory, TOKEN_PREFIX + token + "-" + socket.gethostname())
    try:
        os.makedirs(directory, exist_ok=True)
        with open(path, "w") as handle:
            handle.write(socket.gethostname())
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as error:
        return {"checked": True, "writable": False, "error": f"{error.strerror}: {directory}"}
    return {"checked": True, "writable": True, "path": os.path.realpath(directory)}


def _first_line(path):
    try:
        with open(path) as handle:
            return handle.readline().strip() or None
    except OSError:
        return None


def _namespace(kind):
    try:
        return os.readlink(f"/proc/self/ns/{kind}")
    except OSError:
        return None


def identity():
    """What tells this machine apart from another answering to the same name: the kernel's boot id
    (one per boot of a kernel), the pid and network namespaces (containers on one kernel), and
    /etc/machine-id (one per installation, but shared by images cloned without clearing it)."""
    return {"boot_id": _first_line("/proc/sys/kernel/random/boot_id"), "pid_namespace": _namespace("pid"),
            "net_namespace": _namespace("net"), "machine_id": _first_line("/etc/machine-id")}


def _unescape(field):
    """/proc/self/mountinfo writes a space in a mount point as \\040 (octal)."""
    return re.sub(r"\\([0-7]{3})", lambda code: chr(int(code.group(1), 8)), field)


def filesystem_type(directory, mountinfo="/proc/self/mountinfo"):
    """The type of the mount holding ``directory`` ("nfs4", "lustre", "ext4", ...), or None: the
    longest mount point containing it; of several on one point, the last mounted (it hides the others)."""
    path, best, kind = os.path.realpath(directory), "", None
    try:
        with open(mountinfo) as table:
            for line in table:
                fields = line.split()
                # ID PARENT DEV ROOT MOUNT_POINT OPTIONS [OPTIONAL...] - TYPE SOURCE OPTIONS
                point, point_kind = _unescape(fields[4]), fields[fields.index("-") + 1]
                inside = path == point or path.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, kind = point, point_kind
    except (OSError, ValueError, IndexError):
        return None
    return kind


def offset_from(before, after, mtime_ns, whole_seconds):
    """(offset, uncertainty) in seconds: this host's clock minus the file system's. The file system's
    moment lies within the round trip; a file system that keeps whole seconds truncates up to 1 s.

    Args:
        before: time.time() just before the file was created.
        after: time.time() just after its time was read.
        mtime_ns: the time the file system gave it, in ns.
        whole_seconds: the file system keeps times in whole seconds only.
    """
    stamp, resolution = mtime_ns / 1e9, 1.0 if whole_seconds else 0.0
    offset = (before + after) / 2 - (stamp + resolution / 2)
    return offset, (after - before) / 2 + resolution / 2


def _timed_create(path):
    """(time before, time after, mtime in ns) of creating ``path``, which is removed again."""
    before = time.time()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        # fstat, not stat: NFS answers the create with the attributes the server set.
        mtime_ns = os.fstat(fd).st_mtime_ns
        after = time.time()
    finally:
        os.close(fd)
        os.remove(path)
    return before, after, mtime_ns


def clock_offset(directory, token):
    """This host's clock against the one that sets file times in ``directory``: {"offset",
    "uncertainty", "whole_seconds"} (seconds), or {"error"}. The probe files' names start apart
    from the token files' (tokens() reads those as host names) and are random: two machines with
    one name may probe at once."""
    stem = os.path.join(directory, f"{TOKEN_PREFIX}clock-{token}-{os.urandom(6).hex()}-")
    try:
        samples = [_timed_create(stem + str(attempt)) for attempt in range(CLOCK_SAMPLES)]
    except OSError as error:
        return {"error": f"{error.strerror}: {directory}"}
    # A time in whole seconds once may be chance; every time, and the file system keeps no finer ones.
    whole_seconds = all(mtime_ns % 10**9 == 0 for _, _, mtime_ns in samples)
    before, after, mtime_ns = min(samples, key=lambda sample: sample[1] - sample[0])
    offset, uncertainty = offset_from(before, after, mtime_ns, whole_seconds)
    return {"offset": offset, "uncertainty": uncertainty, "whole_seconds": whole_seconds}


def checkpoint_facts(directory, token):
    """The token written (the shared-directory check) and, where it could be, the clock probe."""
    found = write_token(directory, token)
    if found.get("writable"):
        found.update(clock=clock_offset(directory, token), filesystem=filesystem_type(directory))
    return found


def facts(args):
    return {
        "hostname": socket.gethostname(),
        "identity": identity(),
        "executable": sys.executable,
        "versions": versions(),
        "cpus": len(os.sched_getaffinity(0)),
        "gpus": gpu_count(),
        "interfaces": interfaces(),
        "checkpoint": checkpoint_facts(args.get("checkpoint_dir"), args["token"]),
    }


def tokens(args):
    """The hosts whose token this host sees (every host lists before any host cleans up)."""
    directory, prefix = args["checkpoint_dir"], TOKEN_PREFIX + args["token"] + "-"
    try:
        seen = sorted(name[len(prefix):] for name in os.listdir(directory) if name.startswith(prefix))
    except OSError as error:
        return {"error": f"{error.strerror}: {directory}", "seen": []}
    return {"seen": seen}


def cleanup(args):
    path = os.path.join(args["checkpoint_dir"], TOKEN_PREFIX + args["token"] + "-" + socket.gethostname())
    try:
        os.remove(path)
    except OSError:
        return {"removed": False}
    return {"removed": True}


def _probe_path(args, what):
    return os.path.join(args["checkpoint_dir"], TOKEN_PREFIX + args["token"] + "-lock-" + what)


def _wait_for(args, what):
    """The other side's marker, or None after LOCK_WAIT s (listed, not stat'ed: listing the
    directory revalidates NFS's cache of names)."""
    name, deadline = os.path.basename(_probe_path(args, what)), time.monotonic() + LOCK_WAIT
    while time.monotonic() < deadline:
        if name in os.listdir(args["checkpoint_dir"]):
            with open(_probe_path(args, what)) as handle:
                return handle.read()
        time.sleep(0.05)
    return None


def _mark(args, what, text):
    """Written aside and renamed into place: the other side lists the directory and reads the
    marker the moment its name appears, which must not be before its text is there."""
    final = _probe_path(args, what)
    with open(final + ".part", "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(final + ".part", final)


def lock_hold(args):
    """Take a flock and an O_EXCL file, hold them until the other host tried (or LOCK_WAIT s)."""
    import fcntl

    result = {"host": socket.gethostname()}
    try:
        handle = open(_probe_path(args, "flock"), "a")
        fd = os.open(_probe_path(args, "excl"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.close(fd)
    except OSError as error:
        _mark(args, "held", "error")
        return dict(result, flock="error", error=f"{error.strerror}: {args['checkpoint_dir']}")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            result["flock"] = "held"
        except OSError as error:
            result.update(flock="none" if error.errno in NO_FLOCK else "error", error=error.strerror)
        _mark(args, "held", result["flock"])
        result["tried"] = _wait_for(args, "tried") is not None
    finally:
        handle.close()  # lets the flock go
        for what in ("flock", "excl", "held", "tried", "held.part", "tried.part"):
            try:
                os.remove(_probe_path(args, what))
            except OSError:
                pass
    return result


def lock_try(args):
    """Once the other host holds them: try its flock (refused, granted or none) and its O_EXCL file."""
    import fcntl

    result = {"host": socket.gethostname()}
    held = _wait_for(args, "held")
    if held is None:
        return dict(result, flock="error", error=f"the holding host's marker did not appear in {LOCK_WAIT} s")
    result["holder"] = held
    try:
        try:
            os.close(os.open(_probe_path(args, "excl"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            result["exclusive"] = False
        except FileExistsError:
            result["exclusive"] = True
        if held != "held":
            return result
        with open(_probe_path(args, "flock"), "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                result["flock"] = "granted"
            except BlockingIOError:
                result["flock"] = "refused"
            except OSError as error:
                result.update(flock="none" if error.errno in NO_FLOCK else "error", error=error.strerror)
    except OSError as error:
        result.update(flock="error", error=f"{error.strerror}: {args['checkpoint_dir']}")
    finally:
        try:
            _mark(args, "tried", "tried")
        except OSError:
            pass
    return result


if __name__ == "__main__":
    action, arguments = sys.argv[1], json.loads(sys.argv[2])
    print(json.dumps({"facts": facts, "tokens": tokens, "cleanup": cleanup, "lock_hold": lock_hold,
                      "lock_try": lock_try}[action](arguments)))

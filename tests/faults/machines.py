"""Another machine, on this one: a command run with its own host name, boot id and pid namespace.

    node1 = subprocess.Popen(machine_command("node1") + [sys.executable, "train.py", ...])

What hvdtrain tells machines apart by, each made to differ: ``socket.gethostname()`` (a UTS
namespace), /proc/sys/kernel/random/boot_id (a file bind-mounted over it in a mount namespace of
the command's own) and ``readlink /proc/self/ns/pid`` (a pid namespace, /proc mounted again so its
pids are its own). Two commands given one host name are two machines with one name (containers
started with a fixed ``--hostname``); the same name and boot id as this machine's make a second
pid namespace of the same boot. The file systems stay those of the test: tmp_path and hung mounts
are seen and written as they are.

How the command runs: ``unshare`` starts a shell as pid 1 of the new namespace, which sets the
name and boot id and runs the command as its child (so the command keeps ordinary signal
handling; a pid 1 would ignore SIGTERM without a handler). unshare itself blocks SIGINT and SIGTERM:
end the machine with SIGKILL of the Popen (``--kill-child`` then kills the whole namespace), and
signal the command by its own pid (``processes.descendants(popen.pid)``).

Needs Linux, root and util-linux's unshare; a test that uses it is skipped, saying why, elsewhere.
"""
import functools
import os
import re
import shutil
import subprocess
import sys
import uuid
from typing import List, Optional

PROBE_TIMEOUT = 20.0

# Run by the namespace's pid 1: "$1" host name, "$2" boot id, then the command. The boot id file is
# written into a tmpfs mounted over /tmp of this mount namespace only, bind-mounted onto the kernel's,
# and /tmp unmounted again: the bind keeps the file, and nothing is left on the machine's disks.
_SET_UP_MACHINE = r"""set -e
echo "$1" > /proc/sys/kernel/hostname
mount -t tmpfs -o size=16k,mode=0755 hvdtrain-boot-id /tmp
printf '%s\n' "$2" > /tmp/boot_id
mount --bind /tmp/boot_id /proc/sys/kernel/random/boot_id
umount -l /tmp
shift 2
"$@"
"""
_HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.-]{0,63}$")
_BOOT_ID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def machine_command(hostname: str, boot_id: Optional[str] = None) -> List[str]:
    """The argv prefix that runs a command as on another machine named ``hostname``, booted as
    ``boot_id`` (a fresh random one when None); append the command to it. Skips the calling test
    where such a machine cannot be made."""
    require_machines()
    return _unshare_argv(hostname, boot_id or str(uuid.uuid4()))


def _unshare_argv(hostname: str, boot_id: str) -> List[str]:
    if not _HOST_NAME.match(hostname):
        raise ValueError(f"host name {hostname!r}: letters, digits, '.' and '-', at most 64")
    if not _BOOT_ID.match(boot_id):
        raise ValueError(f"boot id {boot_id!r}: a lower-case UUID, as /proc/sys/kernel/random/boot_id holds")
    return ["unshare", "--uts", "--pid", "--fork", "--kill-child", "--mount-proc", "--",
            "/bin/sh", "-c", _SET_UP_MACHINE, "hvdtrain-machine", hostname, boot_id]


@functools.lru_cache(maxsize=None)
def machines_missing() -> Optional[str]:
    """Why another machine cannot be made here, or None when it can (tried once, with ``true``)."""
    if not sys.platform.startswith("linux"):
        return "another machine is made of Linux namespaces"
    if os.geteuid() != 0:
        return "another machine needs root (unshare of UTS, mount and pid namespaces)"
    if shutil.which("unshare") is None:
        return "no unshare (util-linux) on PATH"
    try:
        probe = subprocess.run(_unshare_argv("hvdtrain-probe", str(uuid.uuid4())) + ["true"],
                               capture_output=True, text=True, timeout=PROBE_TIMEOUT)
    except subprocess.TimeoutExpired:
        return f"unshare did not finish in {PROBE_TIMEOUT} s"
    if probe.returncode != 0:
        return f"unshare is not permitted here: {probe.stderr.strip()[-300:]}"
    return None


def require_machines() -> None:
    """Skips the calling test, saying why, where another machine cannot be made."""
    reason = machines_missing()
    if reason:
        import pytest
        pytest.skip(reason)

"""What a cluster site gives a user, built on the two test hosts (tests/cluster/harness.py).

  * a non-root user known to both hosts: a passwd and a group line bind-mounted over the hosts'
    /etc/passwd and /etc/group inside their mount namespaces (the machine's files are never
    edited), a home on the hosts' shared disk, and an ssh key of its own in ~/.ssh, as on a site;
  * a module-style MPI: the machine's Open MPI reached through a prefix of its own (bin/, lib/,
    the plugin and help-file directories) and a modulefile-like script that puts it first on PATH
    and LD_LIBRARY_PATH, as `module load openmpi` does;
  * a module-style PyTorch: torch and numpy on PYTHONPATH, as `module load pytorch` does on many
    sites (the user's venv then installs no torch of its own);
  * shared storage: a directory the user owns, which both hosts read (they share one disk).

All of it lives in the cluster's state directory and goes with it; the bind mounts go with the
hosts' namespaces.
"""
from __future__ import annotations

import grp
import os
import pwd
import shutil
import subprocess
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Dict, Optional, Sequence, Set

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.cluster.harness import Cluster, ClusterError, Host, Result, run_bounded, run_step

USER_NAME = "hvduser"
FIRST_FREE_ID = 20000  # above the ids Debian hands out to people (1000-59999 are theirs; tests pick >= 20000)
# Open MPI's programs a user runs, or that mpirun starts on the other host (orted), or that build Horovod.
MPI_PROGRAMS = ("mpirun", "mpiexec", "orterun", "orted", "mpicc", "mpicxx", "ompi_info", "opal_wrapper")
# The libraries an MPI program (Horovod's, mpi4py's) loads by soname, found through LD_LIBRARY_PATH.
MPI_LIBRARIES = ("libmpi.so.*", "libopen-pal.so.*", "libopen-rte.so.*", "libmca_common_*.so.*")
# torch requires setuptools on some Pythons; a venv has its own, and a second on PYTHONPATH would shadow it.
LEFT_TO_THE_VENV = {"setuptools"}


@dataclass
class SiteUser:
    name: str
    uid: int
    gid: int
    home: Path

    def env(self, **extra: str) -> Dict[str, str]:
        """A login-like environment: none of root's, but the site's pip settings (where its
        package index is), which a site sets for everyone."""
        env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
        env.update(HOME=str(self.home), USER=self.name, LOGNAME=self.name, SHELL="/bin/bash",
                   PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8")
        env.update(extra)
        return env


def run_as(user: SiteUser, argv: Sequence[str], timeout: float, env: Dict[str, str], cwd: Path,
           host: Optional[Host] = None) -> Result:
    """Run a command as the user (its uid and gid only, no root groups), in cwd: on a test host,
    or with host None on the login node, the machine itself, which reaches the package index
    (the test hosts' network is their veth alone, as a compute node's is often the cluster's).

    On a host, its root and working directory (-r -w), then cd: a directory carried across into
    the mount namespace (the harness's --wd=.) lies outside its root, where getcwd finds it only
    by reading the parent directories, which a user may not (pip failed there).
    """
    enter = [] if host is None else [flag for part in host.enter()
                                     for flag in (("-r", "-w") if part == "--wd=." else (part,))]
    become = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--clear-groups", "--"]
    cd = ["sh", "-c", 'cd "$0" && exec "$@"', str(cwd)]
    return run_bounded(enter + become + cd + list(argv), timeout, env=env)


def add_user(cluster: Cluster) -> SiteUser:
    """A user that exists only on the test hosts, with a home and an ssh key that both accept."""
    uid = _free_id(lambda i: pwd.getpwuid(i))
    gid = _free_id(lambda i: grp.getgrgid(i))
    home = cluster.homes / USER_NAME
    user = SiteUser(USER_NAME, uid, gid, home)
    etc = cluster.state / "etc"
    etc.mkdir(exist_ok=True)
    (etc / "passwd").write_text(Path("/etc/passwd").read_text() + f"{USER_NAME}:x:{uid}:{gid}::{home}:/bin/bash\n")
    (etc / "group").write_text(Path("/etc/group").read_text() + f"{USER_NAME}:x:{gid}:\n")
    ssh = home / ".ssh"
    ssh.mkdir(parents=True)
    cluster.homes.chmod(0o755)
    run_step("ssh-keygen for the test user", ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / "id_ed25519")])
    shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
    # The user's ssh (plain /usr/bin/ssh, as mpirun calls it) reads this from ~/.ssh of its passwd entry.
    (ssh / "config").write_text("Host *\n  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n"
                                "  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 5\n")
    _chown_tree(home, uid, gid)
    for host in cluster.hosts:
        for name in ("passwd", "group"):
            run_step(f"/etc/{name} with {USER_NAME} on {host.name}",
                     host.enter() + ["mount", "--bind", str(etc / name), f"/etc/{name}"])
    return user


def shared_directory(cluster: Cluster, user: SiteUser) -> Path:
    """The user's directory on the storage both hosts read."""
    shared = cluster.state / "shared"
    shared.mkdir()
    os.chown(shared, user.uid, user.gid)
    return shared


def module_mpi(cluster: Cluster) -> Path:
    """The machine's Open MPI behind a prefix of its own; returns the modulefile-like script.

    Open MPI finds its plugins and help files relative to OPAL_PREFIX, so the prefix mirrors the
    install's layout below its own prefix (on Debian: lib/x86_64-linux-gnu/openmpi, share/openmpi).
    """
    installed = {key: _ompi_path(key) for key in ("prefix", "bindir", "libdir", "incdir", "pkgdatadir")}
    prefix = cluster.state / "site" / "openmpi"
    (prefix / "bin").mkdir(parents=True)
    for program in MPI_PROGRAMS:
        source = Path(installed["bindir"]) / program
        if not source.exists():
            raise ClusterError(f"the machine's Open MPI has no {source}: install openmpi-bin and libopenmpi-dev")
        (prefix / "bin" / program).symlink_to(source.resolve())
    # plugins (libdir/openmpi3), headers (a build's mpicxx) and help files, where OPAL_PREFIX puts them
    for key in ("libdir", "incdir", "pkgdatadir"):
        relative = Path(installed[key]).relative_to(installed["prefix"])
        (prefix / relative).parent.mkdir(parents=True, exist_ok=True)
        if not (prefix / relative).exists():
            (prefix / relative).symlink_to(installed[key])
    libmpi = Path(installed["libdir"], "libmpi.so").resolve().parent  # the directory of the versioned libraries
    lib = prefix / "lib"
    for pattern in MPI_LIBRARIES if not lib.is_symlink() else ():  # a libdir of prefix/lib is mirrored whole
        for library in libmpi.glob(pattern):
            if not (lib / library.name).exists():
                (lib / library.name).symlink_to(library)
    if not list(lib.glob("libmpi.so.*")):
        raise ClusterError(f"no libmpi.so.* beside {installed['libdir']}/libmpi.so: an Open MPI layout this site cannot mirror")
    script = prefix / "modulefile.sh"
    script.write_text(
        "# What `module load openmpi` does on a site: this MPI first on PATH and LD_LIBRARY_PATH.\n"
        f"export MPI_HOME={prefix} OPAL_PREFIX={prefix}\n"
        'export PATH="$MPI_HOME/bin:$PATH" LD_LIBRARY_PATH="$MPI_HOME/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"\n')
    for directory in (cluster.state / "site", prefix):
        directory.chmod(0o755)
    return script


def module_pytorch(cluster: Cluster, python: str) -> Path:
    """torch and numpy of this venv (with what they need) behind a prefix of their own, as a site's
    `module load pytorch` puts its packages on PYTHONPATH; returns the modulefile-like script.

    The packages are links into this venv: a site module costs the test no install of torch.
    """
    packages = cluster.state / "site" / "pytorch" / "site-packages"
    packages.mkdir(parents=True)
    for entry in sorted(_top_level_entries(["torch", "numpy"])):
        (packages / entry.name).symlink_to(entry)
    script = packages.parent / "modulefile.sh"
    script.write_text(
        f"# What `module load pytorch` does on a site: its packages on {python}'s path.\n"
        f'export PYTHONPATH="{packages}${{PYTHONPATH:+:$PYTHONPATH}}"\n')
    for directory in (cluster.state / "site", packages.parent):
        directory.chmod(0o755)
    return script


def _top_level_entries(roots: Sequence[str]) -> Set[Path]:
    """The packages, modules and .dist-info directories of these distributions and of all they require."""
    found: Dict[str, metadata.Distribution] = {}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or name in LEFT_TO_THE_VENV:
            continue
        found[name] = metadata.distribution(name)
        for requirement in map(Requirement, found[name].requires or []):
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    entries = set()
    for distribution in found.values():
        for file in distribution.files or []:
            # bin/ scripts lie outside site-packages (..); __pycache__ and .pth files are the directory's, not theirs
            if ".." not in file.parts and file.parts[0] != "__pycache__" and not file.parts[0].endswith(".pth"):
                entries.add(Path(distribution.locate_file(file.parts[0])))
    return entries


def copy_checkout(source: Path, destination: Path, user: SiteUser) -> None:
    """The repository's tracked and new files (a user's clone), owned by the user."""
    listed = subprocess.run(["git", "-C", str(source), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, timeout=60, check=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (source / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source / name, destination / name)
    _chown_tree(destination, user.uid, user.gid)


def _ompi_path(key: str) -> str:
    found = run_step(f"ompi_info --path {key}", ["ompi_info", "--parsable", "--path", key]).stdout
    # e.g. "path:prefix:/usr"
    return found.strip().split(":", 2)[2]


def _free_id(lookup) -> int:
    for candidate in range(FIRST_FREE_ID, FIRST_FREE_ID + 1000):
        try:
            lookup(candidate)
        except KeyError:
            return candidate
    raise ClusterError(f"no free id in {FIRST_FREE_ID}..{FIRST_FREE_ID + 999} for the test user")


def _chown_tree(top: Path, uid: int, gid: int) -> None:
    for directory, subdirectories, files in os.walk(top):
        for name in [directory, *(os.path.join(directory, f) for f in subdirectories + files)]:
            os.chown(name, uid, gid, follow_symlinks=False)

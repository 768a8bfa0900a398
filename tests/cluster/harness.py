"""A real two-host cluster on one Linux machine, for tests of multi-host launches.

    python tests/cluster/harness.py                       # build, print the step times, tear down
    python tests/cluster/harness.py --hold                # ... and keep it up until Enter is pressed
    python tests/cluster/harness.py --cleanup-leftovers   # after a run that was killed with SIGKILL

What it builds (as root, on Linux):
  * two test hosts, hostA (10.99.0.1) and hostB (10.99.0.2): each a network + UTS namespace with
    its own hostname and its own sshd; a veth pair joins them, both ends named eth0, because
    horovodrun needs one interface name common to every host. Each host also has a mount
    namespace, where the test hosts' hosts file is bind-mounted over /etc/hosts: the names
    resolve there, and the machine's /etc/hosts is never edited;
  * a two-node SLURM cluster on them: munged and slurmctld on hostA, one slurmd on each host.

Everything is torn down on exit, also when a step fails half-way: the daemons it started (and
only those, by the process handles it holds), whatever still runs inside its namespaces (only
the harness starts processes there) and the namespaces. All state lives in one temporary
directory, removed at the end. Network traffic stays on the veth pair between the
two namespaces and on loopback. Each cluster's namespaces carry its own session name, so several
test sessions (two checkouts, CI beside a developer) can run on one machine at once.

Missing system packages are installed with apt-get (openssh-server; slurmd slurmctld
slurm-client munge, without recommends). Every subprocess has a timeout; a failing step raises
ClusterError naming the step, the command and the tail of its output or log.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Set

ETC_HOSTS = Path("/etc/hosts")
NETNS_PREFIX = "hvdtrain-"  # namespace names: hvdtrain-<session>-hostA, hvdtrain-<session>-hostB
HOST_NAMES = ("hostA", "hostB")
STATE_PREFIX = "hvdtrain-cluster-"
SSHD_PRIVSEP_DIR = Path("/run/sshd")  # compiled into Debian's sshd; must exist
POLICY_RC_D = Path("/usr/sbin/policy-rc.d")

# Program -> the Debian package that provides it; installed when the program is missing.
PACKAGES = {
    "/usr/sbin/sshd": "openssh-server",
    "/usr/sbin/munged": "munge",
    "/usr/sbin/slurmctld": "slurmctld",
    "/usr/sbin/slurmd": "slurmd",
    "/usr/bin/sbatch": "slurm-client",
}

APT_UPDATE_TIMEOUT = 300
APT_INSTALL_TIMEOUT = 900
STEP_TIMEOUT = 30  # any single non-apt set-up command
READY_TIMEOUT = 60  # a daemon must answer within this
STOP_TIMEOUT = 10  # a daemon gets this long after SIGTERM before SIGKILL
LOG_TAIL_LINES = 40


class ClusterError(RuntimeError):
    """A set-up or tear-down step failed; the message names the step and shows its output."""


@dataclass
class Result:
    argv: List[str]
    returncode: Optional[int]  # None when it timed out and was killed
    stdout: str
    stderr: str
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.returncode is None

    def describe(self, lines: int = LOG_TAIL_LINES) -> str:
        status = "timed out (killed)" if self.timed_out else f"exit code {self.returncode}"
        return (f"$ {' '.join(self.argv)}\n{status} after {self.seconds:.1f} s\n"
                f"--- stdout (last {lines} lines) ---\n{tail(self.stdout, lines)}\n"
                f"--- stderr (last {lines} lines) ---\n{tail(self.stderr, lines)}")


def tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.rstrip("\n").splitlines()[-lines:])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        return f"--- {path} (last {lines} lines) ---\n{tail(path.read_text(errors='replace'), lines)}"
    except OSError as exc:
        return f"--- {path}: cannot read ({exc}) ---"


def run_bounded(argv: Sequence[str], timeout: float, *, env: Optional[Dict[str, str]] = None,
                cwd: Optional[Path] = None, stdin_text: Optional[str] = None) -> Result:
    """Run a command in its own process group; on timeout kill the whole group, never wait forever.

    Launchers (mpirun, horovodrun, sbatch --wait) start many processes: killing the group
    ends every local one. Ranks on the other test host were started by its sshd or slurmd;
    tear-down ends those by emptying the namespaces.
    """
    start = time.monotonic()
    process = subprocess.Popen(
        list(argv), cwd=cwd, env=env, text=True, start_new_session=True,
        stdin=subprocess.PIPE if stdin_text is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = process.communicate(stdin_text, timeout=timeout)
        code: Optional[int] = process.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        code = None
    return Result(list(argv), code, out, err, time.monotonic() - start)


def run_step(step: str, argv: Sequence[str], timeout: float = STEP_TIMEOUT, **kwargs) -> Result:
    """run_bounded, raising ClusterError (with the step's name and output) unless it exits 0."""
    try:
        result = run_bounded(argv, timeout, **kwargs)
    except OSError as exc:
        raise ClusterError(f"set-up step '{step}' could not start {argv[0]}: {exc}") from exc
    if result.returncode != 0:
        raise ClusterError(f"set-up step '{step}' failed:\n{result.describe()}")
    return result


def skip_reason() -> Optional[str]:
    """Why the cluster cannot be built on this machine, or None when it can."""
    if not sys.platform.startswith("linux"):
        return f"the test cluster needs Linux network namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return (f"the test cluster needs root (network namespaces, /etc/netns, daemons on port 22); "
                f"this runs as uid {os.geteuid()}")
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"the test cluster needs `{tool}` (iproute2 / util-linux), which is not on PATH"
    probe = f"{NETNS_PREFIX}probe-{os.getpid()}"
    added = run_bounded(["ip", "netns", "add", probe], 10)
    if added.returncode != 0:
        return f"`ip netns` is not usable here: `ip netns add` said: {added.stderr.strip() or added.stdout.strip()}"
    run_bounded(["ip", "netns", "delete", probe], 10)
    return None


@contextlib.contextmanager
def _services_not_started() -> Iterator[None]:
    """Keep Debian's package scripts from starting the system sshd, munged and slurm daemons.

    The cluster runs its own daemons with its own configuration; services that apt starts would
    be daemons that the tests did not start and do not stop. policy-rc.d (exit 101 = "do not
    start") is the Debian mechanism; an existing one is left alone, a temporary one removed.
    """
    if POLICY_RC_D.exists():
        yield
        return
    POLICY_RC_D.write_text("#!/bin/sh\n# temporary, from hvdtrain's cluster tests\nexit 101\n")
    POLICY_RC_D.chmod(0o755)
    try:
        yield
    finally:
        POLICY_RC_D.unlink(missing_ok=True)


def ensure_packages() -> List[str]:
    """Install the packages whose programs are missing; returns what was installed."""
    if shutil.which("mpirun") is None:
        raise ClusterError("mpirun is missing: run scripts/setup.sh first (it installs openmpi-bin)")
    missing = sorted({pkg for program, pkg in PACKAGES.items() if not Path(program).exists()})
    if not missing:
        return []
    if shutil.which("apt-get") is None:
        raise ClusterError(f"missing packages {missing} and no apt-get to install them")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run_step("apt-get update", ["apt-get", "update", "-q"], APT_UPDATE_TIMEOUT, env=env)
    with _services_not_started():
        run_step(f"apt-get install {' '.join(missing)}",
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", *missing],
                 APT_INSTALL_TIMEOUT, env=env)
    return missing


@dataclass
class Host:
    name: str  # hostname inside the UTS namespace, and its name in the namespaces' hosts files
    address: str
    netns: str
    sshd: Optional[subprocess.Popen] = None

    def enter(self) -> List[str]:
        """Prefix that runs a command on this host: its network, UTS and mount namespaces (the
        mount namespace holds the hosts file). `--wd=.` keeps the caller's directory, which
        entering a mount namespace would otherwise reset to /."""
        assert self.sshd is not None, f"{self.name} is not up yet"
        return ["nsenter", "-t", str(self.sshd.pid), "-n", "-u", "-m", "--wd=.", "--"]


@dataclass
class Daemon:
    name: str
    process: subprocess.Popen
    log: Path


@dataclass
class Cluster:
    """The two test hosts and the SLURM cluster on them; build() then teardown()."""

    state: Path  # a fresh directory named STATE_PREFIX + session
    python_bin: Path = field(default_factory=lambda: Path(sys.executable).parent)
    hosts: List[Host] = field(default_factory=list)
    timings: Dict[str, float] = field(default_factory=dict)
    installed: List[str] = field(default_factory=list)
    _daemons: List[Daemon] = field(default_factory=list)
    _namespaces: List[str] = field(default_factory=list)
    _made_privsep_dir: bool = False

    def __post_init__(self) -> None:
        if not self.hosts:
            session = self.state.name[len(STATE_PREFIX):] if self.state.name.startswith(STATE_PREFIX) else self.state.name
            self.hosts = [Host(name, f"10.99.0.{i}", f"{NETNS_PREFIX}{session}-{name}")
                          for i, name in enumerate(HOST_NAMES, start=1)]

    # ----- paths and environments the tests use

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def bin(self) -> Path:
        return self.state / "bin"

    @property
    def homes(self) -> Path:
        """Home directories of non-root test users (tests/cluster/user_site.py), on the hosts' shared disk."""
        return self.state / "home"

    @property
    def hostfile(self) -> Path:
        return self.state / "hostfile"

    @property
    def hosts_file(self) -> Path:
        return self.state / "hosts"

    @property
    def slurm_conf(self) -> Path:
        return self.state / "slurm" / "slurm.conf"

    @property
    def slurm_logs(self) -> List[Path]:
        return sorted((self.state / "slurm" / "log").glob("*.log"))

    def env(self, **extra: str) -> Dict[str, str]:
        """Environment for commands on the cluster: our ssh wrapper and the venv first on PATH.

        Launcher variables of an enclosing job (SLURM_*, OMPI_*, PMIX_*, HOROVOD_*) are dropped:
        a test run inside a real SLURM job must not submit into, or join, that job.
        """
        inherited = {k: v for k, v in os.environ.items()
                     if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "HOROVOD_"))}
        path = os.pathsep.join([str(self.bin), str(self.python_bin), os.environ.get("PATH", "")])
        env = dict(inherited, PATH=path, SLURM_CONF=str(self.slurm_conf),
                   OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        env.update(extra)
        return env

    def run_on(self, host: Host, argv: Sequence[str], timeout: float, **kwargs) -> Result:
        """Run a command on a test host, bounded by timeout (its process group is killed then)."""
        kwargs.setdefault("env", self.env())
        return run_bounded(host.enter() + list(argv), timeout, **kwargs)

    # ----- build

    def build(self) -> None:
        """Build everything; on failure the caller's teardown() removes what was built."""
        self._timed("packages (apt-get update + install when missing)",
                    lambda: self.installed.extend(ensure_packages()))
        self._timed("ssh keys and wrappers", self._write_ssh_files)
        self._timed("network namespaces", self._make_network)
        self._timed("sshd on both hosts", self._start_sshds)
        self._timed("munged", self._start_munged)
        self._timed("slurmctld + slurmd x2", self._start_slurm)

    def _timed(self, name: str, step: Callable[[], None]) -> None:
        start = time.monotonic()
        step()
        self.timings[name] = time.monotonic() - start

    def _write_ssh_files(self) -> None:
        ssh = self.state / "ssh"
        ssh.mkdir(mode=0o700)
        self.bin.mkdir()
        for key in ("id_ed25519", "host_key"):
            run_step(f"ssh-keygen {key}", ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / key)])
        shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
        (ssh / "ssh_config").write_text(
            f"Host *\n  IdentityFile {ssh / 'id_ed25519'}\n  User root\n  StrictHostKeyChecking no\n"
            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n  ConnectTimeout 5\n")
        # ssh reads ~/.ssh from the passwd entry, not $HOME: a wrapper first on PATH is how
        # mpirun and horovodrun, which call plain `ssh`, get our key without touching ~/.ssh.
        self._write_script("ssh", f'exec /usr/bin/ssh -F {ssh / "ssh_config"} "$@"')
        for host in self.hosts:
            (ssh / f"sshd_config.{host.name}").write_text(
                f"ListenAddress {host.address}:22\nHostKey {ssh / 'host_key'}\n"
                f"PidFile {ssh / f'sshd-{host.name}.pid'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\n"
                # the second file: a non-root test user's own key (tests/cluster/user_site.py)
                f"AuthorizedKeysFile {ssh / 'authorized_keys'} {self.homes}/%u/.ssh/authorized_keys\n"
                "StrictModes no\nUsePAM no\n"
                "PrintMotd no\nUseDNS no\n"
                # launchers open many connections at once; sshd's default drops some
                "MaxStartups 100\nMaxSessions 100\n")
        self.hostfile.write_text("".join(f"{h.name} slots=2\n" for h in self.hosts))

    def _write_script(self, name: str, body: str) -> None:
        path = self.bin / name
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)

    def _make_network(self) -> None:
        self.hosts_file.write_text(hosts_file_text(ETC_HOSTS.read_text(errors="replace"), self.hosts))
        for host in self.hosts:
            run_step(f"create namespace {host.netns}", ["ip", "netns", "add", host.netns])
            self._namespaces.append(host.netns)
        a, b = self.hosts
        # Created straight inside the namespaces, so the host's own eth0 is not involved.
        run_step("create veth pair", ["ip", "link", "add", "eth0", "netns", a.netns, "type", "veth",
                                      "peer", "name", "eth0", "netns", b.netns])
        for host in self.hosts:
            ns = ["ip", "-n", host.netns]
            run_step(f"address {host.address}", ns + ["addr", "add", f"{host.address}/24", "dev", "eth0"])
            run_step(f"lo up on {host.name}", ns + ["link", "set", "lo", "up"])
            run_step(f"eth0 up on {host.name}", ns + ["link", "set", "eth0", "up"])

    def _start_sshds(self) -> None:
        if not SSHD_PRIVSEP_DIR.exists():
            SSHD_PRIVSEP_DIR.mkdir(mode=0o755)
            self._made_privsep_dir = True
        ssh = self.state / "ssh"
        for host in self.hosts:
            # `nsenter`, `unshare` and `exec` all replace themselves, so the process we hold IS
            # sshd, and it holds the host's namespaces open for nsenter. Not `ip netns exec`: it
            # mounts a fresh /sys, without the cgroup filesystem slurmd insists on. unshare makes
            # the new mount namespace private: the bind mount stays inside it.
            argv = ["nsenter", f"--net=/run/netns/{host.netns}", "unshare", "--mount", "--uts", "--",
                    "sh", "-c", 'mount --bind "$1" /etc/hosts && hostname "$0" && exec /usr/sbin/sshd -D -f "$2" -E "$3"',
                    host.name, str(self.hosts_file), str(ssh / f"sshd_config.{host.name}"),
                    str(ssh / f"sshd-{host.name}.log")]
            host.sshd = self._start_daemon(f"sshd on {host.name}", argv, ssh / f"sshd-{host.name}.out").process
        for host in self.hosts:  # on-hostA, on-hostB: for a person debugging with --hold
            self._write_script(f"on-{host.name}", " ".join(host.enter()) + ' "$@"')
        for target in self.hosts:  # each host reaches both by name, with its own hostname
            self._wait_until(
                f"ssh from {self.head.name} to {target.name}",
                lambda t=target: self.run_on(self.head, ["ssh", t.name, "hostname"], 10).stdout.strip() == t.name,
                logs=[ssh / f"sshd-{h.name}.log" for h in self.hosts])

    def _start_munged(self) -> None:
        # A munged of our own (own key, socket, pid, log): a system munged is not touched.
        munge = self.state / "munge"
        munge.mkdir()
        # munged insists that everyone may traverse to its socket (and no one else may write)
        for directory in (self.state, munge):
            directory.chmod(0o711)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        argv = ["/usr/sbin/munged", "--foreground", f"--socket={munge / 'munge.socket'}",
                f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"]
        self._start_daemon("munged", self.head.enter() + argv, munge / "munged.out")
        roundtrip = ["sh", "-c", 'munge -n -S "$0" | unmunge -S "$0"', str(munge / "munge.socket")]
        self._wait_until("munge credential round trip",
                         lambda: run_bounded(roundtrip, 10).returncode == 0,
                         logs=[munge / "munged.log", munge / "munged.out"])

    def _start_slurm(self) -> None:
        slurm = self.state / "slurm"
        for sub in ("ctld", "log", "run", *(f"{kind}-{h.name}" for h in self.hosts for kind in ("spool", "tmp"))):
            (slurm / sub).mkdir(parents=True)
        self.slurm_conf.write_text(slurm_conf(slurm, self.hosts, self.state / "munge" / "munge.socket"))
        env = self.env()
        self._start_daemon("slurmctld", self.head.enter() + ["/usr/sbin/slurmctld", "-D"],
                           slurm / "log" / "slurmctld.out", env=env)
        for host in self.hosts:
            self._start_daemon(f"slurmd on {host.name}", host.enter() + ["/usr/sbin/slurmd", "-D"],
                               slurm / "log" / f"slurmd-{host.name}.out", env=env)
        wanted = "".join(f"{h.name} idle\n" for h in self.hosts)
        logs = [slurm / "log" / "slurmctld.log", *(slurm / "log" / f"slurmd-{h.name}.log" for h in self.hosts)]
        self._wait_until("both SLURM nodes idle",
                         lambda: self.run_on(self.head, ["sinfo", "-h", "-N", "-o", "%N %t"], 10).stdout == wanted,
                         logs=logs)

    def _start_daemon(self, name: str, argv: List[str], out: Path,
                      env: Optional[Dict[str, str]] = None) -> Daemon:
        """Start a daemon in the foreground, as our child: we hold its handle, so stopping it can
        never hit a reused PID, and it is recorded before anything else can fail."""
        with open(out, "ab") as sink:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                                       env=env, start_new_session=True)
        daemon = Daemon(name, process, out)
        self._daemons.append(daemon)
        return daemon

    def _wait_until(self, what: str, ready: Callable[[], bool], logs: Sequence[Path]) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [d for d in self._daemons if d.process.poll() is not None]
            if dead:
                raise ClusterError(self._failure(f"waiting for {what}: {dead[0].name} exited "
                                                 f"with code {dead[0].process.returncode}", logs))
            time.sleep(0.25)
        raise ClusterError(self._failure(f"'{what}' not reached in {READY_TIMEOUT} s", logs))

    def _failure(self, message: str, logs: Sequence[Path]) -> str:
        paths = dict.fromkeys([*logs, *(d.log for d in self._daemons)])  # ordered, no repeats
        return "\n".join([f"set-up step failed: {message}"] + [log_tail(p) for p in paths if p.exists()])

    # ----- teardown

    def teardown(self) -> List[str]:
        """Undo everything build() did, as far as it got. Every step is attempted; returns problems."""
        problems: List[str] = []
        for step in (self._stop_daemons, self._empty_namespaces, self._delete_namespaces,
                     self._remove_privsep_dir):
            try:
                problems.extend(step())
            except Exception as exc:  # keep tearing down; report all of it at the end
                problems.append(f"{step.__name__}: {exc!r}")
        return problems

    def _stop_daemons(self) -> List[str]:
        problems = []
        for daemon in reversed(self._daemons):  # slurmd before slurmctld before munged before sshd
            process = daemon.process
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(STOP_TIMEOUT)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(STOP_TIMEOUT)
                    problems.append(f"{daemon.name} (pid {process.pid}) ignored SIGTERM; killed")
        self._daemons.clear()
        return problems

    def _empty_namespaces(self) -> List[str]:
        """Kill what still runs in our namespaces: only the harness starts processes there, so
        these are job steps that outlived their slurmd (slurmstepd lingers a few seconds after a
        job) or ranks of a launch that timed out, orphaned by their daemon."""
        problems, killed = [], set()
        for netns in self._namespaces:
            for _ in range(20):
                pids = [int(p) for p in run_bounded(["ip", "netns", "pids", netns], 10).stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                killed.update(pids)
                time.sleep(0.25)
            else:
                problems.append(f"processes {pids} in {netns} did not die")
        _wait_reaped(killed, STOP_TIMEOUT)
        return problems

    def _delete_namespaces(self) -> List[str]:
        problems = []
        for netns in list(self._namespaces):
            result = run_bounded(["ip", "netns", "delete", netns], 10)
            if result.returncode == 0:
                self._namespaces.remove(netns)
            else:
                problems.append(f"could not delete namespace {netns}: {result.stderr.strip()}")
        return problems

    def _remove_privsep_dir(self) -> List[str]:
        if self._made_privsep_dir:
            with contextlib.suppress(OSError):  # not empty: a system sshd uses it now
                SSHD_PRIVSEP_DIR.rmdir()
        return []


def slurm_conf(slurm: Path, hosts: Sequence[Host], munge_socket: Path) -> str:
    """slurm.conf for the two test hosts; see the comments on the settings that are not defaults."""
    cpus = os.cpu_count() or 1
    nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} RealMemory=1000 State=UNKNOWN\n"
                    for h in hosts)
    return f"""\
ClusterName=hvdtrain-ci
SlurmctldHost={hosts[0].name}({hosts[0].address})
SlurmUser=root
SlurmdUser=root
MailProg=/bin/true
AuthType=auth/munge
# our own munged, not the system one; cred_expire=5: a requeued job may start again after 5 s,
# not 120 s (needs a fresh slurmctld, which every harness run is)
AuthInfo=socket={munge_socket},cred_expire=5
SchedulerParameters=sched_interval=2,bf_interval=1
StateSaveLocation={slurm}/ctld
# %n: two slurmd on one machine need separate spool, pid, log and TmpFS (PMIx app dirs)
SlurmdSpoolDir={slurm}/spool-%n
TmpFS={slurm}/tmp-%n
SlurmctldPidFile={slurm}/run/slurmctld.pid
SlurmdPidFile={slurm}/run/slurmd-%n.pid
SlurmctldLogFile={slurm}/log/slurmctld.log
SlurmdLogFile={slurm}/log/slurmd-%n.log
# no cgroups in a test machine
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# Debian's Open MPI knows PMIx only
MpiDefault=pmix
ReturnToService=2
# sbatch --wait returns 2-4 s after the job ends instead of ~10 s
MinJobAge=4
KillWait=5
{nodes}PartitionName=debug Nodes={','.join(h.name for h in hosts)} Default=YES MaxTime=INFINITE State=UP
"""


def _wait_reaped(pids: Set[int], timeout: float) -> None:
    """Killed orphans linger as zombies until init reaps them (well under a second here): wait,
    so that a check for leftover daemons right after the tests does not see their corpses."""
    deadline = time.monotonic() + timeout
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if Path(f"/proc/{pid}").exists()}
        time.sleep(0.1)


def hosts_file_text(machine_hosts: str, hosts: Sequence[Host]) -> str:
    """The test hosts' hosts file: the machine's own (localhost and the rest), without lines
    that name a test host, which would shadow it, then one line per test host."""
    names = {h.name.lower() for h in hosts}
    kept = [line for line in machine_hosts.splitlines()
            if not names & set(line.split("#", 1)[0].lower().split()[1:])]
    return "".join(f"{line}\n" for line in kept) + "".join(f"{h.address} {h.name}\n" for h in hosts)


def namespaces_on_machine() -> List[str]:
    # `ip netns list` prints "name" or "name (id: 3)" per line
    listed = run_bounded(["ip", "netns", "list"], 10).stdout.splitlines()
    return [line.split()[0] for line in listed if line.strip()]


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """`timeout` and CI runners stop pytest with SIGTERM, which skips cleanup by default:
    turned into KeyboardInterrupt, it unwinds through the tear-down like Ctrl-C does."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the tear-down short
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def running_cluster() -> Iterator[Cluster]:
    """Build the cluster, yield it, and always tear it down, also after a failed build."""
    state = Path(tempfile.mkdtemp(prefix=STATE_PREFIX))
    cluster = Cluster(state)
    with _sigterm_as_interrupt():
        try:
            cluster.build()
            yield cluster
        finally:
            problems = cluster.teardown()
            shutil.rmtree(state, ignore_errors=True)
            if problems:
                # Raising here would hide an exception already on its way out: report it then.
                message = "cluster tear-down problems:\n  " + "\n  ".join(problems)
                if sys.exc_info()[0] is None:
                    raise ClusterError(message)
                print(message, file=sys.stderr)


def cleanup_leftovers() -> List[str]:
    """Remove what runs killed with SIGKILL left: processes in the harness's namespaces (only the
    harness starts processes there), the namespaces and the state directories.
    Every session's, so only when no cluster test runs on this machine."""
    done = []
    for netns in namespaces_on_machine():
        if netns.startswith(NETNS_PREFIX) and netns.endswith(tuple(f"-{name}" for name in HOST_NAMES)):
            leftover = Cluster(Path(tempfile.gettempdir()), hosts=[Host("", "", netns)], _namespaces=[netns])
            problems = leftover._empty_namespaces() + leftover._delete_namespaces()
            done.append(f"namespace {netns}: " + ("; ".join(problems) if problems else "emptied and deleted"))
    for state in Path(tempfile.gettempdir()).glob(STATE_PREFIX + "*"):
        shutil.rmtree(state, ignore_errors=True)
        done.append(f"removed {state}")
    return done


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hold", action="store_true", help="keep the cluster up until Enter is pressed")
    parser.add_argument("--cleanup-leftovers", action="store_true",
                        help="remove what killed runs left (only when no cluster test is running)")
    args = parser.parse_args(argv)
    reason = skip_reason()
    if reason:
        print(f"cannot build the test cluster: {reason}", file=sys.stderr)
        return 2
    if args.cleanup_leftovers:
        print("\n".join(cleanup_leftovers()) or "nothing left over")
        return 0
    try:
        return _build_and_report(args.hold)
    except ClusterError as exc:
        print(exc, file=sys.stderr)
        return 1


def _build_and_report(hold: bool) -> int:
    start = time.monotonic()
    with running_cluster() as cluster:
        built = time.monotonic() - start
        for step, seconds in cluster.timings.items():
            print(f"{seconds:7.1f} s  {step}")
        installed = f" (installed {' '.join(cluster.installed)})" if cluster.installed else ""
        print(f"{built:7.1f} s  cluster built{installed}")
        if hold:
            print(f"\nexport PATH={cluster.bin}:{cluster.python_bin}:$PATH SLURM_CONF={cluster.slurm_conf} "
                  f"OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1\n"
                  f"on-hostA sinfo; on-hostA ssh hostB hostname; hostfile: {cluster.hostfile}\n"
                  "Press Enter to tear the cluster down.")
            with contextlib.suppress(EOFError):
                input()
        start = time.monotonic()
    print(f"{time.monotonic() - start:7.1f} s  torn down")
    return 0


if __name__ == "__main__":
    sys.exit(main())

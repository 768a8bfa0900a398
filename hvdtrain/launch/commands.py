"""The exact command line each launcher needs, as pure functions of one LaunchSpec."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from hvdtrain.launch.hostfile import Host, HostfileError, check_hostname, to_host_list, total_slots

# Variables every rank needs from the launching shell; mpirun passes none unless told (-x). The
# lease's beat must be the same on the rank 0 of every host that may own the checkpoint directory,
# and the compile cache's key file is where every host finds the one key that signs the cache.
DEFAULT_EXPORTS = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "HVDTRAIN_LEASE_BEAT",
                   "HVDTRAIN_COMPILE_CACHE_KEY_FILE")


def exports_present(environ: Mapping[str, str]) -> List[str]:
    """The DEFAULT_EXPORTS set in ``environ``: mpirun -x of an unset name is an error."""
    return [name for name in DEFAULT_EXPORTS if name in environ]


@dataclass(frozen=True)
class LaunchSpec:
    np: int
    command: Sequence[str]
    hosts: Sequence[Host] = ()  # empty: this host only
    network_interface: Optional[str] = None
    exports: Sequence[str] = field(default=DEFAULT_EXPORTS)
    as_root: bool = False
    start_timeout: int = 30  # seconds to reach every host before the launch fails
    # (name, value) every rank gets, wherever it runs: what hvdtrain launch tells the ranks of itself.
    # horovodrun and srun pass their whole environment on: the runner sets these in it instead.
    rank_variables: Tuple[Tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if self.np < 1:
            raise ValueError(f"-np must be >= 1, got {self.np}")
        if not self.command:
            raise ValueError("no command to launch: put it after the options, e.g. -- python train.py")
        if self.hosts and self.np > total_slots(self.hosts):
            raise HostfileError(
                f"-np {self.np} asks for more ranks than the {total_slots(self.hosts)} slots of "
                f"{to_host_list(self.hosts)}: lower -np or add slots"
            )
        if self.network_interface is not None:
            check_hostname(self.network_interface, "--network-interface")
        if self.start_timeout < 1:
            raise ValueError(f"--start-timeout must be >= 1 second, got {self.start_timeout}")


def openmpi_argv(spec: LaunchSpec) -> List[str]:
    """Open MPI's mpirun, with the flags horovodrun would add for the same job."""
    argv = ["mpirun", "-np", str(spec.np)]
    if spec.as_root:
        argv.append("--allow-run-as-root")
    if spec.hosts:
        # A host that is down would leave ssh (and so mpirun) waiting for minutes; BatchMode
        # turns a password prompt, which nobody would answer, into an error.
        argv += ["-H", to_host_list(spec.hosts),
                 "-mca", "plm_rsh_args", f"-o ConnectTimeout={spec.start_timeout} -o BatchMode=yes"]
    # No binding (Horovod's background thread needs a core of its own), ranks filled host by host;
    # ob1 + no openib: the TCP/shared-memory path that works everywhere.
    argv += ["-bind-to", "none", "-map-by", "slot", "-mca", "pml", "ob1", "-mca", "btl", "^openib"]
    if spec.network_interface:
        argv += ["-mca", "btl_tcp_if_include", spec.network_interface,
                 "-mca", "oob_tcp_if_include", spec.network_interface,
                 "-x", f"NCCL_SOCKET_IFNAME={spec.network_interface}"]
    for name in spec.exports:
        argv += ["-x", name]
    for name, value in spec.rank_variables:
        argv += ["-x", f"{name}={value}"]
    return argv + list(spec.command)


def mpich_argv(spec: LaunchSpec) -> List[str]:
    """MPICH/Intel MPI's Hydra mpiexec."""
    argv = ["mpiexec", "-n", str(spec.np)]
    if spec.hosts:
        argv += ["-hosts", to_host_list(spec.hosts)]
    if spec.network_interface:
        argv += ["-iface", spec.network_interface, "-genv", "NCCL_SOCKET_IFNAME", spec.network_interface]
    if spec.exports:
        argv += ["-genvlist", ",".join(spec.exports)]
    for name, value in spec.rank_variables:
        argv += ["-genv", name, value]
    return argv + list(spec.command)


def horovodrun_argv(spec: LaunchSpec) -> List[str]:
    argv = ["horovodrun", "-np", str(spec.np), "--start-timeout", str(spec.start_timeout)]
    if spec.hosts:
        argv += ["-H", to_host_list(spec.hosts)]
    if spec.network_interface:
        argv += ["--network-interface", spec.network_interface]
    return argv + list(spec.command)


def srun_argv(spec: LaunchSpec) -> List[str]:
    """srun inside an allocation; PMIx is what Debian's and most sites' Open MPI speak."""
    # --kill-on-bad-exit=1: a rank that dies ends the step (as mpirun does), instead of the others
    # waiting in a collective until the time limit.
    argv = ["srun", "--mpi=pmix", "--kill-on-bad-exit=1", f"--ntasks={spec.np}"]
    if spec.hosts:
        argv.append("--nodelist=" + ",".join(h.name for h in spec.hosts))
    if spec.network_interface:
        argv.append(f"--export=ALL,NCCL_SOCKET_IFNAME={spec.network_interface}")
    return argv + list(spec.command)


BUILDERS: Dict[str, Callable[[LaunchSpec], List[str]]] = {
    "mpirun": openmpi_argv,
    "mpich": mpich_argv,
    "horovodrun": horovodrun_argv,
    "srun": srun_argv,
}

# How a tool of hvdtrain (a benchmark, a layout check) starts its own worker jobs.
JOB_LAUNCHERS = ("none", "mpirun", "horovodrun")


def job_argv(command: Sequence[str], np: int, launcher: str, hosts: Sequence[Host] = (),
             environ: Optional[Mapping[str, str]] = None) -> List[str]:
    """A command line that runs a command on several ranks under a launcher.

    Args:
        command: the command (this Python's, usually).
        np: ranks.
        launcher: none (one process, as is), mpirun, or horovodrun over Gloo (the horovodrun beside this Python,
            activated or not).
        hosts: the hosts and their slots (default: this one).
        environ: the environment that decides which launcher binaries to use (None: this process's).
    """
    environ = os.environ if environ is None else environ
    if launcher == "none":
        if np != 1:
            raise ValueError(f"launcher 'none' runs one process, not {np}")
        return list(command)
    spec = LaunchSpec(np=np, command=list(command), hosts=hosts, exports=exports_present(environ),
                      as_root=hasattr(os, "geteuid") and os.geteuid() == 0)
    if launcher == "mpirun":
        return openmpi_argv(spec)
    if launcher == "horovodrun":
        argv = horovodrun_argv(spec)
        beside = Path(sys.executable).parent / "horovodrun"
        return [str(beside) if beside.exists() else argv[0], "--gloo", *argv[1:]]
    raise ValueError(f"unknown launcher {launcher!r}: choose one of {', '.join(JOB_LAUNCHERS)}")

"""Launching a job: the launcher's command line from the options, and running it with a time limit,
passing on the signals a scheduler sends (preemption's USR1 among them), stopping every process of
the job on TERM, INT and HUP, and naming the rank that failed first. The command is hvdtrain.cli.launch.

What each launcher does with a signal sent to its process group, measured with a rank that logs what
it receives (Open MPI 4.1.4, Horovod 0.28.1; srun and Hydra's mpiexec read from their source):

    signal       mpirun                   horovodrun (MPI)          horovodrun --gloo          srun
    USR1, USR2   forwarded, job goes on   forwarded by its mpirun   ranks get TERM, it dies    forwarded
    TERM, INT    ranks: TERM, 1 s: KILL   as mpirun                 ranks: TERM, later KILL    TERM: KILL
    HUP          as TERM                  as mpirun                 ranks get TERM, it dies    KILL

horovodrun over MPI becomes ``sh -c "mpirun ..."``: that shell dies of every one of them at once,
and its mpirun and ranks run on unless they got the signal too. Open MPI refuses to forward TERM, INT
or HUP even when asked (ess_base_forward_signals); srun takes one INT for a status report; Hydra's
mpiexec forwards USR1, and dies of USR2 and HUP.

So only USR1 and USR2 reach the ranks as themselves (PASSED_ON): one that a launcher does not
forward goes straight to the ranks on this host, which is enough for a preemption (the ranks' vote
carries one rank's signal to all). TERM, INT and HUP end the job under every launcher (STOPPING):
TERM to the launcher, KILL to every process left GRACE_SECONDS later, exit code 128 + the signal,
nothing orphaned. The ranks are told (rank_variables) and refuse a train.preempt_signal that cannot
reach them (hvdtrain.fault_tolerance.preemption). docs/how-to/launching.md has the measurements.
"""
from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO, Deque, Dict, List, Optional, Sequence, Tuple

from hvdtrain.launch.commands import BUILDERS, LaunchSpec, exports_present
from hvdtrain.launch.failures import first_failed_rank, rank_host
from hvdtrain.launch.hostfile import Host, hosts_from_options, total_slots
from hvdtrain.launch.sessions import descendants_running, kill_session, session_members

GRACE_SECONDS = 10  # between the TERM that stops a job and the KILL of whatever is left of it
POLL_SECONDS = 0.1  # how often the launcher's end is looked for

# Sent to hvdtrain launch, these reach the ranks as themselves and the job goes on (their default
# action would kill the launcher alone, leaving mpirun and the ranks running).
PASSED_ON = (signal.SIGUSR1, signal.SIGUSR2)
# These end the whole job: no launcher passes them on as themselves (see the table above).
STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
# Which of PASSED_ON each launcher forwards to every rank itself, once: hvdtrain sends it to the
# launcher's process group, which holds the launcher but not the ranks (each rank has a group of its
# own), so that no rank gets it twice. The others go to the ranks on this host directly.
LAUNCHER_PASSES: Dict[str, Tuple[signal.Signals, ...]] = {
    "mpirun": (signal.SIGUSR1, signal.SIGUSR2),
    "srun": (signal.SIGUSR1, signal.SIGUSR2),
    "mpich": (signal.SIGUSR1,),
    "horovodrun": (),
}
# What every rank is told of its launch; hvdtrain.fault_tolerance.preemption reads the same names.
LAUNCHER_VARIABLE = "HVDTRAIN_LAUNCHER"
SIGNALS_VARIABLE = "HVDTRAIN_LAUNCH_SIGNALS"


def rank_variables(launcher: str) -> Dict[str, str]:
    """The variables every rank of a launch gets: the launcher's name and the signals sent to
    hvdtrain launch that reach the ranks (comma-separated names, USR1,USR2)."""
    return {LAUNCHER_VARIABLE: launcher, SIGNALS_VARIABLE: ",".join(sig.name[3:] for sig in PASSED_ON)}


def build_command(args: argparse.Namespace, environ=os.environ) -> Tuple[List[str], LaunchSpec]:
    hosts = hosts_from_options(args.hostfile, args.hosts) or []
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    spec = LaunchSpec(
        np=args.np or total_slots(hosts) or 1,
        command=command,
        hosts=hosts,
        network_interface=args.network_interface,
        exports=exports_present(environ),
        as_root=hasattr(os, "geteuid") and os.geteuid() == 0,
        start_timeout=args.start_timeout,
        rank_variables=tuple(rank_variables(args.launcher).items()),
    )
    return BUILDERS[args.launcher](spec), spec


def _say(message: str) -> None:
    """One line on stderr, unless stderr is gone (the terminal closed: the HUP that stops the job)."""
    try:
        print(message, file=sys.stderr, flush=True)
    except (OSError, RuntimeError):  # RuntimeError: a signal handler's line while the main one prints
        pass


def _relay(stream: IO[str], sink: IO[str], keep: Deque[str]) -> None:
    """Copy the launcher's stderr through, keeping its tail to find the failed rank in. A sink that
    fails (a closed terminal) is skipped, never left unread: the launcher would block writing."""
    for line in stream:
        keep.append(line)
        try:
            sink.write(line)
            sink.flush()
        except OSError:
            continue


class RunningJob:
    """A launcher started in a session of its own, and what a signal sent to hvdtrain launch does to it."""

    def __init__(self, process: subprocess.Popen, launcher: str, rank_command: Sequence[str]) -> None:
        self.process = process
        self.launcher = launcher
        self.rank_command = list(rank_command)
        self.stopped_by: Optional[int] = None  # the STOPPING signal that ended the job, if one did
        self._kill_at: Optional[float] = None  # when whatever is left of a stopped job is killed

    def on_signal(self, signum: int, _frame=None) -> None:
        if signum in PASSED_ON:
            self.pass_on(signum)
        else:
            self.stop(signum)

    def pass_on(self, signum: int) -> None:
        """To the launcher if it forwards ``signum`` to every rank, else to the ranks on this host."""
        if signum in LAUNCHER_PASSES[self.launcher]:
            self._signal_launcher(signum)
            return
        ranks = descendants_running(self.process.pid, self.rank_command)
        for pid in ranks:
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass
        if not ranks:
            _say(f"hvdtrain launch: {signal.Signals(signum).name} reached no rank: {self.launcher} does not pass "
                 f"it on, and no rank runs on this host")

    def stop(self, signum: Optional[int]) -> None:
        """End the job (``signum``: the signal that asked; None: the time limit): TERM to the
        launcher now, KILL to every process of the launch GRACE_SECONDS later, at once if asked again."""
        now = time.monotonic()
        if self._kill_at is None:
            self._kill_at = now + GRACE_SECONDS
            self.stopped_by = signum
            if signum is not None:
                _say(f"hvdtrain launch: {signal.Signals(signum).name}: stopping every rank")
        else:
            self._kill_at = now
        self._signal_launcher(signal.SIGTERM)

    def wait(self, timeout: Optional[float]) -> Optional[int]:
        """The launcher's exit code once the job has ended, or None when ``timeout`` seconds
        (None: no limit) passed first. A stopped job has ended when every process of its launch
        has: horovodrun's shell, for one, exits at once while its mpirun still ends the ranks."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._ended():
            now = time.monotonic()
            if self._kill_at is not None and now >= self._kill_at:
                kill_session(self.process.pid)
            elif self._kill_at is None and deadline is not None and now >= deadline:
                return None
            time.sleep(POLL_SECONDS)
        return self.process.wait()

    def _ended(self) -> bool:
        if self.process.poll() is None:
            return False
        return self._kill_at is None or not session_members(self.process.pid)

    def _signal_launcher(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass


def execute(argv: List[str], timeout: Optional[float], hosts: Sequence[Host] = (), launcher: str = "mpirun",
            rank_command: Sequence[str] = ()) -> int:
    """Run the launcher in a session of its own until the job ends, and return its exit code: 124
    past ``timeout``, 128 + the signal when TERM, INT or HUP stopped it (every process of the launch
    is gone either way). USR1 and USR2 sent to this process reach the ranks (RunningJob.pass_on).

    Args:
        argv: the launcher's command line (build_command).
        timeout: seconds before the whole job is stopped; None: no limit.
        hosts: the hosts of the job, to name the one of a failed rank.
        launcher: which of LAUNCHER_PASSES ``argv`` starts.
        rank_command: the ranks' command line, to find them on this host by.
    """
    try:
        process = subprocess.Popen(argv, start_new_session=True, stderr=subprocess.PIPE, text=True,
                                   env=dict(os.environ, **rank_variables(launcher)))
    except FileNotFoundError:
        _say(f"hvdtrain launch: {argv[0]} not found on PATH: install it or choose another --launcher")
        return 127
    job = RunningJob(process, launcher, rank_command)
    tail: Deque[str] = collections.deque(maxlen=400)
    relay = threading.Thread(target=_relay, args=(process.stderr, sys.stderr, tail), daemon=True)
    relay.start()
    # A signal ignored from the start stays ignored: nohup's HUP must not stop the job at logout.
    previous = {sig: signal.signal(sig, job.on_signal) for sig in PASSED_ON + STOPPING
                if signal.getsignal(sig) != signal.SIG_IGN}
    try:
        code = job.wait(timeout)
        if code is None:
            _say(f"hvdtrain launch: the job ran past --timeout {timeout:g} s; stopping every rank")
            job.stop(None)
            job.wait(None)
            return 124
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    relay.join(timeout=GRACE_SECONDS)
    if job.stopped_by is not None:
        _say(f"hvdtrain launch: stopped by {signal.Signals(job.stopped_by).name}; every process of the job has ended")
        return 128 + job.stopped_by
    if code != 0:
        _say(f"hvdtrain launch: the job failed with exit code {code}: {culprit(''.join(tail), hosts)}")
    return code


def culprit(output: str, hosts: Sequence[Host]) -> str:
    """Who failed first, as the launcher's ``output`` names it."""
    failed = first_failed_rank(output)
    if failed is None:
        return "the launcher's messages above say more"
    rank, host = failed
    return f"rank {rank} on {host or rank_host(rank, hosts, socket.gethostname())} failed first"

"""hvdtrain launch's runner (hvdtrain.launch.runner) with a stand-in launcher: a small Python program
that starts its ranks each in a process group of its own, as mpirun does, and ignores TERM, the
worst case. What a signal sent to hvdtrain launch does to the job, and what the ranks are told of
it so that they refuse a train.preempt_signal that cannot reach them."""
import argparse
import os
import signal
import sys
import threading
import time

import pytest

from hvdtrain.common.errors import HvdtrainError
from hvdtrain.fault_tolerance.preemption import PreemptionFlag, PreemptionRefused
from hvdtrain.launch import runner
from hvdtrain.launch.commands import BUILDERS
from hvdtrain.launch.sessions import kill_session

pytestmark = pytest.mark.timeout(60)

LAUNCHER = """
import signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only KILL ends it
np, rank = int(sys.argv[1]), sys.argv[2:]
ranks = [subprocess.Popen(rank, process_group=0) for _ in range(np)]
sys.exit(max(r.wait() for r in ranks))
"""
# Logs each signal it gets to DIRECTORY/got.<pid>, ignores TERM, and exits 0 one second after a USR2.
RANK = """
import os, signal, sys, time
from pathlib import Path
log = Path(sys.argv[1]) / f"got.{os.getpid()}"
got = []
def note(signum, frame):
    got.append(signum)
    with log.open("a") as out:
        out.write(signal.Signals(signum).name + "\\n")
for each in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(each, note)
(Path(sys.argv[1]) / f"ready.{os.getpid()}").touch()
deadline = time.monotonic() + 50
while time.monotonic() < deadline and signal.SIGUSR2 not in got:
    time.sleep(0.02)
time.sleep(1)
"""


@pytest.fixture
def job(tmp_path, monkeypatch):
    """(the launcher's command line, the ranks' command line, the directory the ranks write to); every
    process of it is killed at the end, whatever the test did."""
    monkeypatch.setattr(runner, "GRACE_SECONDS", 1.0)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "rank.py").write_text(RANK)
    rank_command = [sys.executable, str(tmp_path / "rank.py"), str(tmp_path)]
    yield [sys.executable, str(tmp_path / "launcher.py"), "2", *rank_command], rank_command, tmp_path
    for pid in ranks_started(tmp_path):
        if alive(pid):
            kill_session(os.getsid(pid))


def ranks_started(directory):
    return [int(path.name.split(".")[1]) for path in directory.glob("ready.*")]


def alive(pid):
    """Running, not a zombie waiting for its parent."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def signal_self_when_ready(directory, signum):
    """Once both ranks are up, send ``signum`` to this process, if hvdtrain launch's handler is in
    place or the signal is ignored (else, so as not to end the test run, kill the job: the test then
    fails on its outcome)."""
    def send():
        deadline = time.monotonic() + 30
        while len(ranks_started(directory)) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        if callable(signal.getsignal(signum)) or signal.getsignal(signum) == signal.SIG_IGN:
            os.kill(os.getpid(), signum)
        else:
            for pid in ranks_started(directory):
                os.kill(pid, signal.SIGKILL)
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def signals_got(directory):
    return {path.name: path.read_text().split() for path in directory.glob("got.*")}


@pytest.mark.parametrize("name", ["HUP", "INT", "TERM"])
def test_hup_int_and_term_stop_every_process_of_the_job_even_when_the_launcher_ignores_term(job, name, capsys):
    launcher, ranks, directory = job
    signum = getattr(signal, f"SIG{name}")
    signal_self_when_ready(directory, signum)
    started = time.monotonic()
    code = runner.execute(launcher, timeout=40, launcher="mpirun", rank_command=ranks)
    assert code == 128 + signum, capsys.readouterr().err
    assert time.monotonic() - started < 20
    started_ranks = ranks_started(directory)
    assert len(started_ranks) == 2 and not [pid for pid in started_ranks if alive(pid)]
    err = capsys.readouterr().err
    assert f"hvdtrain launch: stopped by {signum.name}; every process of the job has ended" in err, err
    assert signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler)  # handed back


def test_a_hup_ignored_from_the_start_stays_ignored(job):
    """Under nohup (HUP ignored), closing the terminal does not stop the job: it ends as the ranks
    decide (here on a USR2, which hvdtrain sends them itself: the stand-in forwards nothing)."""
    launcher, ranks, directory = job
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        def hang_up_then_end():
            signal_self_when_ready(directory, signal.SIGHUP).join()
            time.sleep(0.5)  # what the HUP would do, done
            signal_self_when_ready(directory, signal.SIGUSR2)
        threading.Thread(target=hang_up_then_end, daemon=True).start()
        code = runner.execute(launcher, timeout=40, launcher="horovodrun", rank_command=ranks)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert code == 0
    assert sorted(signals_got(directory).values()) == [["SIGUSR2"], ["SIGUSR2"]]


def test_the_time_limit_ends_ranks_that_live_in_process_groups_of_their_own(job, capsys):
    launcher, ranks, directory = job
    code = runner.execute(launcher, timeout=3, launcher="mpirun", rank_command=ranks)
    assert code == 124
    started_ranks = ranks_started(directory)
    assert len(started_ranks) == 2 and not [pid for pid in started_ranks if alive(pid)], "a rank outlived the limit"
    assert "ran past --timeout 3 s; stopping every rank" in capsys.readouterr().err


def test_a_signal_the_launcher_would_die_of_goes_to_the_ranks_on_this_host(job):
    """Hydra's mpiexec does not forward USR2 (it would die of it): each rank gets it once, from
    hvdtrain launch, and the job ends as the ranks decide."""
    launcher, ranks, directory = job
    signal_self_when_ready(directory, signal.SIGUSR2)
    code = runner.execute(launcher, timeout=40, launcher="mpich", rank_command=ranks)
    assert code == 0
    assert sorted(signals_got(directory).values()) == [["SIGUSR2"], ["SIGUSR2"]]


def test_every_launcher_says_which_signals_it_passes_on():
    assert set(runner.LAUNCHER_PASSES) == set(BUILDERS)
    for passed in runner.LAUNCHER_PASSES.values():
        assert set(passed) <= set(runner.PASSED_ON)
    assert not set(runner.PASSED_ON) & set(runner.STOPPING)


def launch_options(launcher):
    return argparse.Namespace(hostfile=None, hosts="hostA:2,hostB:2", np=None, network_interface=None,
                              start_timeout=30, launcher=launcher, command=["--", "python", "train.py"])


@pytest.mark.parametrize("launcher, told", [
    ("mpirun", ["-x", "HVDTRAIN_LAUNCHER=mpirun", "-x", "HVDTRAIN_LAUNCH_SIGNALS=USR1,USR2"]),
    ("mpich", ["-genv", "HVDTRAIN_LAUNCHER", "mpich", "-genv", "HVDTRAIN_LAUNCH_SIGNALS", "USR1,USR2"]),
])
def test_ranks_on_every_host_are_told_which_signals_reach_them(launcher, told):
    argv, _ = runner.build_command(launch_options(launcher), environ={})
    position = argv.index(told[0])
    assert argv[position:position + len(told)] == told
    assert argv[-2:] == ["python", "train.py"]


@pytest.mark.parametrize("name", ["INT", "HUP", "TERM", "sigterm"])
def test_a_preempt_signal_that_cannot_reach_the_ranks_is_refused_in_one_line(name):
    told = runner.rank_variables("mpirun")  # what hvdtrain launch exports to every rank
    previous = signal.getsignal(signal.SIGHUP)
    with pytest.raises(PreemptionRefused) as refused:
        PreemptionFlag(name, environ=told)
    message = str(refused.value)
    assert isinstance(refused.value, HvdtrainError) and "\n" not in message
    assert message.startswith(f"train.preempt_signal={name.upper().removeprefix('SIG')} cannot ask for a checkpoint "
                              f"under hvdtrain launch --launcher mpirun")
    assert "mpirun: TERM, then KILL a second later" in message
    assert message.endswith("Set train.preempt_signal=USR1 and have SLURM send it before the time limit with "
                            "#SBATCH --signal=B:USR1@90")
    assert signal.getsignal(signal.SIGHUP) is previous  # nothing armed


@pytest.mark.parametrize("name, environ", [("USR1", runner.rank_variables("horovodrun")),
                                           ("USR2", runner.rank_variables("srun")),
                                           ("HUP", {}), ("", runner.rank_variables("mpirun"))])
def test_what_can_reach_the_ranks_is_armed(name, environ):
    number = getattr(signal, f"SIG{name or 'USR1'}")
    previous = signal.getsignal(number)
    try:
        flag = PreemptionFlag(name, environ=environ)
        if name:
            signal.raise_signal(number)
            assert flag._requested
    finally:
        signal.signal(number, previous)

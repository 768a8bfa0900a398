"""``hvdtrain launch`` passes a scheduler's signals on to the job: SLURM's preemption warning (USR1,
``--signal=B:USR1@90`` sends it to the batch shell's processes, the launcher among them) reaches
every rank once, the job checkpoints and ends as preempted, and the launcher returns its exit code.
HUP, INT and TERM, which mpirun, horovodrun and srun turn into a kill of the ranks, stop every process
of the job, and a train.preempt_signal among them is refused before training starts."""
import re
import signal
import subprocess
import time

import pytest

from hvdtrain.launch.sessions import descendants_running, session_members
from tests.launch.helpers import BIN, PYTHON, ROOT, kill_session, launch_env, run, signal_when

HVDTRAIN = str(BIN / "hvdtrain")
JOB_TIMEOUT = 420.0  # a guard against a job that ignores the signal, not a speed bound
# The job's own deadline must fire before pytest-timeout's (300 s by default): the test then kills
# the job's processes and reports its output, rather than a stack dump leaving them running.
pytestmark = pytest.mark.timeout(JOB_TIMEOUT + 60)


def signal_when_stepped(argv, directory, signum, ranks=None, timeout=JOB_TIMEOUT):
    """Start ``argv``, send ``signum`` to its first process (or to the processes running the command
    ``ranks``) once rank 0 has stepped three times, and return (exit code, stdout, stderr); every
    process of it is killed if it does not end in time."""
    code, out, err, left = signal_when(argv, directory / "stepped", signum, ranks, timeout)
    assert not left, f"processes {left} of the job outlived the launcher"
    return code, out, err


def assert_checkpointed_as_preempted(out, checkpoints):
    """The run said it was preempted after step 3 or later, and its checkpoint holds that step."""
    said = re.findall(r"preempted at step (\d+); run again to resume", out)
    assert len(said) == 1, out[-2000:]
    step = int(said[0])
    assert step >= 3
    assert (checkpoints / f"ckpt-{step:09d}.pt").is_file(), sorted(p.name for p in checkpoints.iterdir())


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_usr1_at_the_launcher_checkpoints_every_rank_and_ends_the_job_as_preempted(launcher, tmp_path):
    code, out, err = signal_when_stepped(
        [HVDTRAIN, "launch", "--launcher", launcher, "-np", "2", "--timeout", "400", "--",
         PYTHON, "tests/launch/signal_job.py", "train", str(tmp_path)], tmp_path, signal.SIGUSR1)
    assert code == 0, err[-3000:]
    assert_checkpointed_as_preempted(out, tmp_path / "ckpt")


def test_term_with_preempt_on_term_checkpoints_instead_of_dying(tmp_path):
    """SLURM's GraceTime preemption sends TERM to every task (then KILL): with train.preempt_on_term
    the ranks checkpoint and end as preempted."""
    job = [PYTHON, "tests/launch/signal_job.py", "train", str(tmp_path), "--train.preempt_on_term=true"]
    code, out, err = signal_when_stepped(["mpirun", "-np", "2", "--oversubscribe", *job], tmp_path,
                                         signal.SIGTERM, ranks=job)
    assert code == 0, err[-3000:]
    assert_checkpointed_as_preempted(out, tmp_path / "ckpt")


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun"])
def test_each_rank_gets_a_forwarded_usr2_exactly_once(launcher, tmp_path):
    """USR2 (the ranks' flight recorder dump) reaches every rank once, and the launcher lives on."""
    process = subprocess.Popen([HVDTRAIN, "launch", "--launcher", launcher, "-np", "2", "--timeout", "200", "--",
                                PYTHON, "tests/launch/signal_count_job.py", str(tmp_path)],
                               cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 200
        while len(list(tmp_path.glob("ready.*"))) < 2:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks did not start in time"
            time.sleep(0.05)
        process.send_signal(signal.SIGUSR2)  # each rank counts what arrives for 2 s, then exits 0
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the ranks did not end after the USR2 (the launcher's exit: {process.poll()}): it did "
                        f"not reach them")
    finally:
        kill_session(process.pid)
    counts = {path.name: int(path.read_text()) for path in tmp_path.glob("usr2.*")}
    assert counts == {"usr2.0": 1, "usr2.1": 1}, (counts, err[-3000:])
    assert process.returncode == 0, err[-3000:]


# After the signal: mpirun ends its ranks within 2 s, and hvdtrain launch kills what is left after 10.
STOP_TIMEOUT = 60


def stop_when_stepped(argv, directory, signum):
    """Start the launch ``argv``, send ``signum`` to hvdtrain launch once rank 0 has stepped three
    times, and return (exit code, stdout, stderr, the ranks' pids, the launch's processes left once
    hvdtrain launch has exited). Every process of it is killed at the end."""
    job = argv[argv.index("--") + 1:]
    process = subprocess.Popen(argv, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + JOB_TIMEOUT
        while not (directory / "stepped").exists():
            assert process.poll() is None, f"the launch ended (exit {process.returncode}) before step 3"
            assert time.monotonic() < deadline, "no step 3 in time"
            time.sleep(0.05)
        ranks = descendants_running(process.pid, job)
        assert len(ranks) == 2, ranks
        process.send_signal(signum)
        try:
            out, err = process.communicate(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:  # what is left holds the output pipes open
            out, err = "", f"(no end of output {STOP_TIMEOUT} s after the signal)"
        left = session_members(process.pid) if process.poll() is not None else ["hvdtrain launch itself"]
        return process.returncode, out, err, ranks, left
    finally:
        kill_session(process.pid)
        process.communicate()


def running(pid):
    """Running, not a zombie waiting for its parent."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("launcher, name", [("mpirun", "HUP"), ("mpirun", "INT"), ("mpirun", "TERM"),
                                            ("horovodrun", "HUP")])
def test_hup_int_and_term_at_the_launcher_stop_every_process_of_the_job(launcher, name, tmp_path):
    """A closed terminal (HUP), Ctrl-C or a TERM: no rank, mpirun or horovodrun outlives hvdtrain
    launch, which exits 128 + the signal and says why; the run did not end as preempted."""
    signum = getattr(signal, f"SIG{name}")
    code, out, err, ranks, left = stop_when_stepped(
        [HVDTRAIN, "launch", "--launcher", launcher, "-np", "2", "--timeout", "400", "--",
         PYTHON, "tests/launch/signal_job.py", "train", str(tmp_path)], tmp_path, signum)
    assert not left, f"processes {left} of the job outlived hvdtrain launch (exit {code})\n{err[-3000:]}"
    assert not [pid for pid in ranks if running(pid)], "a rank outlived hvdtrain launch"
    assert code == 128 + signum, err[-3000:]
    assert f"hvdtrain launch: stopped by {signum.name}; every process of the job has ended" in err, err[-3000:]
    assert "preempted at step" not in out


@pytest.mark.parametrize("name", ["INT", "HUP", "TERM"])
def test_a_preempt_signal_that_cannot_reach_the_ranks_is_refused_before_training(name, tmp_path):
    """mpirun answers INT, HUP and TERM by killing the ranks a second later: a preemption on one of
    them could never checkpoint, so the ranks refuse it at start, in one line, with what to use."""
    code, out, err = run([HVDTRAIN, "launch", "-np", "2", "--timeout", "90", "--", PYTHON, "tests/launch/signal_job.py",
                          "train", str(tmp_path), f"--train.preempt_signal={name}"], timeout=150)
    refusals = [line for line in err.splitlines() if line.startswith("hvdtrain: ")]
    assert len(refusals) == 1, err[-3000:]
    assert refusals[0].startswith(f"hvdtrain: train.preempt_signal={name} cannot ask for a checkpoint under hvdtrain "
                                  f"launch --launcher mpirun"), refusals
    assert refusals[0].endswith("#SBATCH --signal=B:USR1@90"), refusals
    assert "Traceback" not in out + err, err[-3000:]
    assert code == 2, (code, err[-3000:])
    assert not (tmp_path / "stepped").exists()
    assert not list((tmp_path / "ckpt").glob("ckpt-*")), "it trained"

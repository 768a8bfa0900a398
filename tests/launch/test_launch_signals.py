"""``hvdtrain launch`` passes a scheduler's signals on to the job: SLURM's preemption warning (USR1,
``--signal=B:USR1@90`` sends it to the batch shell's processes, the launcher among them) reaches
every rank once, the job checkpoints and ends as preempted, and the launcher returns its exit code."""
import re
import signal
import subprocess
import time

import pytest

from tests.launch.helpers import BIN, PYTHON, ROOT, kill_session, launch_env, signal_when

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

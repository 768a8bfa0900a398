"""``hvdtrain launch`` never lets a job run forever, and names the rank that failed (that it runs
train.py on a hostfile's slots to the stated accuracy: tests/launch/test_main_job.py)."""
import socket
import time

from tests.launch.helpers import BIN, PYTHON, run

HVDTRAIN = str(BIN / "hvdtrain")


def test_launch_stops_a_job_past_its_timeout_with_exit_124():
    started = time.monotonic()
    code, out, err = run([HVDTRAIN, "launch", "-np", "2", "--timeout", "3", "--",
                          PYTHON, "-c", "import time; time.sleep(120)"], timeout=60)
    assert code == 124
    assert "ran past --timeout 3 s; stopping every rank" in err
    assert time.monotonic() - started < 30


def test_a_rank_that_dies_ends_the_job_with_a_non_zero_exit():
    crash = ("import os, torch, horovod.torch as hvd; hvd.init(); "
             "os._exit(3) if hvd.rank() == 1 else hvd.allreduce(torch.ones(1), name='x')")
    started = time.monotonic()
    code, out, err = run([HVDTRAIN, "launch", "-np", "2", "--timeout", "120", "--", PYTHON, "-c", crash],
                         timeout=150)
    assert code != 0 and code != 124
    assert "Exit code:    3" in err or "exit code 3" in err.lower()
    assert f"the job failed with exit code {code}: rank 1 on {socket.gethostname()} failed first" in err
    assert time.monotonic() - started < 60

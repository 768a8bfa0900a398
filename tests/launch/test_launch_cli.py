"""``hvdtrain launch`` starts real jobs and never lets one run forever."""
import socket
import time

from tests.launch.helpers import BIN, PYTHON, run

HVDTRAIN = str(BIN / "hvdtrain")


def test_launch_runs_train_py_on_the_hostfile_slots(tmp_path):
    code, out, err = run([HVDTRAIN, "launch", "--hostfile", "hostfiles/localhost", "--timeout", "240",
                          "--", PYTHON, "train.py", "--epochs", "2", f"--train.run_dir={tmp_path}"])
    assert code == 0, err[-3000:]
    assert "started by Open MPI mpirun" in out
    assert "held-out digits, 2 workers" in out


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

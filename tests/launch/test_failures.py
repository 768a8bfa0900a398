"""A rank that dies or stalls ends the whole job, in bounded time, saying which rank and where."""
import re
import socket
import time

import pytest

from tests.launch.helpers import BIN, PYTHON, run

HVDTRAIN = str(BIN / "hvdtrain")
HOST = socket.gethostname()


@pytest.mark.parametrize("launcher", ["mpirun", "horovodrun --gloo"])
def test_a_stalled_rank_ends_the_job_naming_itself_and_what_the_others_wait_for(launcher):
    prefix = {"mpirun": ["mpirun", "-np", "2"],
              "horovodrun --gloo": [str(BIN / "horovodrun"), "-np", "2", "--gloo"]}[launcher]
    started = time.monotonic()
    code, out, err = run(prefix + [PYTHON, "tests/launch/stall_job.py", "5"], timeout=120)
    elapsed = time.monotonic() - started
    output = out + err
    assert code != 0
    assert elapsed < 60, f"the job took {elapsed:.0f} s to end"
    assert (f"STALL rank 1 on {HOST}: no step finished for" in output
            and "not waiting in any collective: THIS rank stopped calling them" in output), output[-3000:]
    # Rank 0 is one step ahead, in the first collective of the step rank 1 never reached: the count of
    # its scored targets (train.loss_mean=tokens: hvdtrain.components.token_mean), before any gradient's.
    assert f"STALL rank 0 on {HOST}" in output and "waiting in allreduce 'train.scored_tokens'" in output


def test_a_rank_hung_in_its_checkpoint_write_ends_the_job_naming_itself_and_its_file(tmp_path):
    """Rank 1's shard write moves 1000 bytes and hangs; rank 0 waits for it in the save's collective.
    Before the I/O watch, the paused watchdog let both hang until this test's timeout (the guard)."""
    code, out, err = run(["mpirun", "-np", "2", PYTHON, "tests/launch/save_stall_job.py", str(tmp_path / "ckpt"), "3"],
                         timeout=180)
    output = out + err
    # The save's temporary directory is named after the lease's claim: .ckpt-000000002.tmp-<token>.
    shard = re.escape(str(tmp_path / "ckpt")) + r"/\.ckpt-000000002\.tmp-[0-9a-f]{16}/rank-00001-of-00002\.pt"
    assert code != 0
    assert (re.search(f"STALL rank 1 on {HOST}: the checkpoint write of {shard} moved no byte for", output)
            and "1000 bytes written so far" in output and "checkpoint_timeout=3 s" in output), output[-3000:]


def test_a_crashed_rank_launched_through_horovodrun_is_named_with_its_host():
    crash = ("import os, torch, horovod.torch as hvd; hvd.init(); "
             "os._exit(3) if hvd.rank() == 1 else hvd.allreduce(torch.ones(1), name='x')")
    started = time.monotonic()
    code, out, err = run([HVDTRAIN, "launch", "--launcher", "horovodrun", "-np", "2", "--timeout", "120",
                          "--", PYTHON, "-c", crash], timeout=150)
    assert code not in (0, 124)
    assert time.monotonic() - started < 60
    assert f"rank 1 on {HOST} failed first" in err, err[-3000:]

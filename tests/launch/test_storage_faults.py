"""An operator's bad day, on one machine: a mount that hangs, an owner paused past its lease, two
machines with one host name (tests/faults). Each case failed on the code before: the job hung to
its time limit with no STALL line, or a deposed owner published over its successor's checkpoints,
or a machine of the same name took a live run's directory at once.

Each job is one process (tests/launch/storage_fault_job.py); every wait is bounded, and every
process is ended by the test's own clean-up whatever happens.
"""
import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.faults import HungMount, machine_command, pause_when_blocked, require_fuse
from tests.launch.helpers import PYTHON, ROOT, finish, kill_session, launch_env

JOB = [PYTHON, "tests/launch/storage_fault_job.py"]
STALL_EXIT_CODE = 75  # hvdtrain.fault_tolerance.watchdog's
# A stalled job ends within checkpoint_timeout (3 s) + the watchdog's poll (< 1 s) + the grace it
# gives the other ranks to report (interval + 2 s) + a bounded dump; 90 s leaves room for a loaded CI.
STALL_WITHIN = 90
BEAT = "0.5"  # the lease's beat: a takeover of a gone owner 1.5 s after the taker first looks

pytestmark = pytest.mark.timeout(300)


def start(argv, env=None, **popen):
    return subprocess.Popen(argv, cwd=ROOT, env=launch_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)


def wait_for_line(process, wanted, timeout=120):
    """Reads ``process``'s stdout until a line ``wanted``; the lines read."""
    deadline, lines = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        lines.append(line.strip())
        if line.strip() == wanted:
            return lines
    kill_session(process.pid)
    pytest.fail(f"no line {wanted!r} within {timeout} s: {lines}\n{process.stderr.read()[-4000:]}")


@pytest.fixture
def mount(tmp_path):
    require_fuse()
    with HungMount(tmp_path / "disk") as hung:
        yield hung


def test_a_hang_in_the_lease_check_of_a_save_prints_stall_and_ends_the_job(mount):
    """The first storage call of a save is the lease's renewal (a utime of owner.json); it used to
    run outside any watch, with the step clock paused: the job hung with no word."""
    mount.hang(ops="utime", names="owner.json")
    job = start(JOB + [str(mount.path / "ckpt"), "--checkpoint-timeout", "3"], env={"HVDTRAIN_LEASE_BEAT": "600"})
    try:
        code, out, err = finish(job, STALL_WITHIN)
    finally:
        mount.release()
    assert code == STALL_EXIT_CODE, err[-4000:]
    assert "STALL rank 0" in err and f"the lease renewal of {mount.path / 'ckpt' / 'owner.json'} is stuck in a " \
                                     f"storage call" in err, err[-4000:]
    assert "checkpoint 2" not in out  # the save never returned


def test_a_hang_with_the_run_directory_on_the_same_mount_still_prints_stall_and_ends_the_job(mount):
    """The project's own LM recipe keeps run_dir and checkpoint_dir on one file system. The watchdog
    used to write its flight dump (into run_dir) before printing the STALL line: it blocked in mkdir
    and never exited."""
    job = start(JOB + [str(mount.path / "ckpt"), "--run-dir", str(mount.path / "runs"), "--checkpoint-timeout", "3",
                       "--stall-timeout", "5", "--step-seconds", "0.2", "--max-steps", "200"])
    try:
        wait_for_line(job, "checkpoint 2")
        mount.hang()  # every call on the mount, from now on
        code, out, err = finish(job, STALL_WITHIN)
    finally:
        mount.release()
    assert code == STALL_EXIT_CODE, err[-4000:]
    assert "STALL rank 0" in err, err[-4000:]


def checkpoints(directory):
    """Each published checkpoint's name -> (its bytes' checksum, the claim generation it carries)."""
    found = {}
    for sidecar in sorted(Path(directory).glob("ckpt-*.pt.checksum")):
        record = json.loads(sidecar.read_text())
        found[sidecar.name[:-len(".checksum")]] = (record["xxh3_128"], record.get("lease", {}).get("generation"))
    return found


def run_until_owned(argv, env, within=120):
    """Runs ``argv`` again while it is refused as the directory's owner is live (as a scheduler
    retries a job), for at most ``within`` seconds: (exit code, stdout, stderr) of the last run."""
    deadline = time.monotonic() + within
    while True:
        code, out, err = finish(start(argv, env=env), 240)
        if "is in use by a live run" not in out + err or time.monotonic() > deadline:
            return code, out, err
        time.sleep(1)


def test_a_paused_owner_publishes_nothing_after_a_takeover(mount, tmp_path):
    """Owner A is stopped (SIGSTOP: scontrol suspend, a stalled node) in its save of step 4, after
    the save checked the lease. Another machine takes the directory over once A's lease expired,
    resumes A's step 2 and finishes the run. A, continued, used to rename its step 4 into place,
    move `latest` and go on saving over B's checkpoints; now it publishes nothing and stops."""
    directory, seen_by_b = mount.path / "ckpt", mount.backing / "ckpt"
    # Stopped as it looks up step 4's checksum file to replace it: after its save checked the lease
    # (and, on the code before, before anything of step 4 existed for another run to clear away).
    mount.hang(ops="lookup", names="ckpt-000000004.pt.checksum")
    owner_a = start(JOB + [str(directory), "--max-steps", "12", "--step-seconds", "0.1"],
                    env={"HVDTRAIN_LEASE_BEAT": BEAT})
    try:
        with pause_when_blocked(mount, owner_a, timeout=120):
            code_b, out_b, err_b = run_until_owned(machine_command("hostB") + JOB + [str(seen_by_b), "--max-steps", "12"],
                                                   env={"HVDTRAIN_LEASE_BEAT": BEAT})
            assert code_b == 0 and "done 12" in out_b, err_b[-4000:]
            published_by_b = checkpoints(seen_by_b)
            latest_by_b = (seen_by_b / "latest").read_text()
        code_a, out_a, err_a = finish(owner_a, 120)  # continued when the block ended
    finally:
        kill_session(owner_a.pid)
    assert set(published_by_b) == {"ckpt-000000008.pt", "ckpt-000000010.pt", "ckpt-000000012.pt"}
    assert code_a != 0 and "checkpoint 4" not in out_a, out_a
    assert f"checkpoint_dir {directory} is no longer this run's" in out_a + err_a, (out_a + err_a)[-4000:]
    # Nothing A did after it resumed reached the directory: not a checkpoint, not `latest`, not a prune.
    assert checkpoints(seen_by_b) == published_by_b
    assert (seen_by_b / "latest").read_text() == latest_by_b
    assert sorted(p.name for p in seen_by_b.iterdir()) == sorted(
        [*published_by_b, *(f"{name}.checksum" for name in published_by_b), "latest"])
    said_by_b = out_b + err_b  # rank 0's log lines go to stdout
    assert "its previous owner" in said_by_b and "not renewed while this run watched it" in said_by_b, said_by_b
    assert "resumed at epoch 0, step 2" in said_by_b, said_by_b
    assert {generation for _, generation in published_by_b.values()} == {2}  # B's claim followed A's


CLAIM = ("import logging, sys, time\n"
         "from hvdtrain.checkpoint import CheckpointError\n"
         "from hvdtrain.checkpoint.ownership import Ownership\n"
         "logging.basicConfig(level=logging.INFO)\n"
         "try:\n"
         "    held = Ownership.claim(sys.argv[1], logging.getLogger('claim'))\n"
         "except CheckpointError as error:\n"
         "    print('refused', error, flush=True)\n"
         "    sys.exit(3)\n"
         "print('owned', flush=True)\n"
         "if sys.argv[2] == 'hold':\n"
         "    sys.stdin.read()\n"
         "held.release()\n")


def test_two_machines_with_one_host_name_wait_for_the_lease_to_expire(tmp_path):
    """node1 and node1 again (containers with a fixed --hostname): another boot id under the same
    name used to read as a reboot, and the second took the first's live directory at once."""
    directory = tmp_path / "ckpt"
    first = start(machine_command("node1") + [PYTHON, "-c", CLAIM, str(directory), "hold"],
                  env={"HVDTRAIN_LEASE_BEAT": BEAT}, stdin=subprocess.PIPE)
    try:
        assert first.stdout.readline().strip() == "owned", first.stderr.read()[-2000:]
        second = start(machine_command("node1") + [PYTHON, "-c", CLAIM, str(directory), "release"])
        code, out, err = finish(second, 60)
        assert code == 3 and "is in use by a live run" in out and "renewed its lease while this run watched it" in out, \
            (out, err[-2000:])
    finally:
        kill_session(first.pid)  # killed: its record stays, for the next claim to judge
        first.communicate()
    started = time.monotonic()
    third = start(machine_command("node1") + [PYTHON, "-c", CLAIM, str(directory), "release"])
    code, out, err = finish(third, 60)
    waited = time.monotonic() - started
    assert code == 0 and out.strip() == "owned", (out, err[-2000:])
    assert "its lease was not renewed while this run watched it for 1.5 s" in err, err[-2000:]
    assert waited >= 1.5, f"taken over after {waited:.1f} s, before its lease could expire"

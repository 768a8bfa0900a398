"""The run lock of a checkpoint directory, a lease, on every file system's kind of flock.

Each host is a process with its own host name (ownership.host_name, replaced). The file systems
are simulated by what flock does there, in every process: nothing (ENOSYS: Lustre without
``-o flock``), a lock per node (it always succeeds: NFS ``local_lock``, Lustre ``localflock``,
BeeGFS), or a coherent lock that a dead host still holds (held forever by another process). The
lease uses no flock, so every case must come out the same on each. Time passing is simulated by
ageing the record's modification time (its last renewal), never by sleeping.
"""
import errno
import fcntl
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest

from hvdtrain.checkpoint import CheckpointError, ownership
from hvdtrain.checkpoint.ownership import OWNER, Owner, Ownership, read_owner

LOG = logging.getLogger("test")
LONG_BEAT = 60.0  # no renewal happens during a test: the record's age is what the test makes it
pytestmark = pytest.mark.timeout(120)

FLOCKS = {
    "no-flock": "import errno, fcntl\n"
                "def flock(fd, op): raise OSError(errno.ENOSYS, 'Function not implemented')\n"
                "fcntl.flock = flock\n",
    "node-local-flock": "import fcntl\nfcntl.flock = lambda fd, op: None\n",
    "coherent-flock-held-by-a-dead-host": "",
}


def no_flock(fd, operation):
    raise OSError(errno.ENOSYS, "Function not implemented")


@pytest.fixture(params=sorted(FLOCKS))
def file_system(request, tmp_path, monkeypatch):
    """(the checkpoint directory, the flock patch every other process applies); this process
    gets the same flock."""
    directory = tmp_path / "ckpt"
    directory.mkdir()
    holder = None
    if request.param == "no-flock":
        monkeypatch.setattr(fcntl, "flock", no_flock)
    elif request.param == "node-local-flock":
        monkeypatch.setattr(fcntl, "flock", lambda fd, operation: None)
    else:  # the server keeps the dead host's lock
        holder = subprocess.Popen([sys.executable, "-c",
                                   "import fcntl, sys; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
                                   "print('held', flush=True); sys.stdin.read()", str(directory / ".hvdtrain.lock")],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
    yield directory, FLOCKS[request.param]
    if holder is not None:
        holder.communicate("", timeout=30)


def as_host(monkeypatch, name):
    monkeypatch.setattr(ownership, "host_name", lambda: name)


def host_process(directory, host, patch, then="sys.stdin.read()", beat=LONG_BEAT, env=None, wait_for=None):
    """Another process on ``host`` (with the file system's flock) that claims ``directory``, says
    'owned PID' or 'refused MESSAGE', then runs ``then``. ``wait_for``: a file it waits for first."""
    code = (patch + "import logging, os, sys, time\n"
            "from hvdtrain.checkpoint import CheckpointError, ownership\n"
            f"ownership.host_name = lambda: {host!r}\n"
            f"while {str(wait_for)!r} != 'None' and not os.path.exists({str(wait_for)!r}): time.sleep(0.005)\n"
            "try:\n"
            f"    held = ownership.Ownership.claim({str(directory)!r}, logging.getLogger(), beat={beat!r})\n"
            "except CheckpointError as error:\n"
            "    print('refused', error, flush=True); sys.exit(3)\n"
            "print('owned', os.getpid(), flush=True)\n" + then)
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HOROVOD_"))}
    environ.update(env or {})
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=environ)


def owned_by(process):
    line = process.stdout.readline().split()
    assert line[:1] == ["owned"], (line, process.communicate(timeout=30))
    return int(line[1])


def killed(process):
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL


def age(directory, seconds):
    """As if the owner had not renewed its lease for ``seconds``."""
    then = time.time() - seconds
    os.utime(directory / OWNER, (then, then))


@pytest.fixture(autouse=True)
def outside_any_job(monkeypatch):
    for name in [n for n in os.environ if n.startswith(("SLURM_", "HOROVOD_"))]:
        monkeypatch.delenv(name)


def test_a_live_owner_on_another_host_is_refused_naming_it(file_system, monkeypatch):
    directory, patch = file_system
    holder = host_process(directory, "hostA", patch)
    pid = owned_by(holder)
    as_host(monkeypatch, "hostB")
    try:
        with pytest.raises(CheckpointError, match=rf"is in use by a live run \(pid {pid} on hostA, started .*"
                                                  rf"renews every 60 s.*another checkpoint_dir"):
            Ownership.claim(directory, LOG)
        assert read_owner(directory).pid == pid  # untouched
    finally:
        holder.communicate("", timeout=30)
    assert read_owner(directory) is None  # its end released it


def test_a_killed_owner_on_another_host_is_taken_over_once_its_lease_expired(file_system, monkeypatch, caplog):
    directory, pid = owner_killed_on_host_a(file_system, monkeypatch, "hostB")
    age(directory, 2.9 * LONG_BEAT)  # two beats missed, the third not yet
    with pytest.raises(CheckpointError, match=rf"in use by a live run \(pid {pid} on hostA"):
        Ownership.claim(directory, LOG)
    age(directory, 3.1 * LONG_BEAT)
    with caplog.at_level(logging.WARNING):
        taken = Ownership.claim(directory, LOG)
    assert f"its previous owner (pid {pid} on hostA" in caplog.text and "its lease expired" in caplog.text
    assert read_owner(directory).host == "hostB" and read_owner(directory).pid == os.getpid()
    taken.release()
    assert read_owner(directory) is None


def owner_killed_on_host_a(file_system, monkeypatch, then_as, env=None):
    """An owner on hostA (with ``env``) killed, its lease not yet expired; this process then plays
    host ``then_as``. Returns the directory and the killed owner's pid."""
    directory, patch = file_system
    holder = host_process(directory, "hostA", patch, env=env)
    pid = owned_by(holder)
    killed(holder)
    as_host(monkeypatch, then_as)
    return directory, pid


def after_slurm_job_4242_killed_on_host_a(file_system, monkeypatch, job):
    """SLURM job 4242's owner on hostA killed; this process is then SLURM job ``job``'s restart 1
    on hostB. Returns the directory."""
    directory, _ = owner_killed_on_host_a(file_system, monkeypatch, "hostB", env={"SLURM_JOB_ID": "4242"})
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    return directory


def test_a_requeue_of_the_same_slurm_job_takes_over_at_once(file_system, monkeypatch, caplog):
    directory = after_slurm_job_4242_killed_on_host_a(file_system, monkeypatch, "4242")
    with caplog.at_level(logging.WARNING):
        taken = Ownership.claim(directory, LOG)
    assert "SLURM job 4242's requeue" in caplog.text
    assert read_owner(directory).host == "hostB" and read_owner(directory).restart == 1
    taken.release()


def test_another_slurm_job_is_refused_at_once(file_system, monkeypatch):
    directory = after_slurm_job_4242_killed_on_host_a(file_system, monkeypatch, "4243")
    with pytest.raises(CheckpointError, match=r"in use by a live run \(SLURM job 4242, pid"):
        Ownership.claim(directory, LOG)


def test_the_same_run_in_another_process_takes_over_when_no_beat_comes(file_system, monkeypatch, caplog):
    """Horovod elastic's next rank 0 (another process of the same run, on another host) waits
    1.5 beats for the previous one's beat; it never comes from a killed process."""
    directory, patch = file_system
    rendezvous = {"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": "4711"}
    holder = host_process(directory, "hostA", patch, beat=0.2, env=rendezvous)
    owned_by(holder)
    killed(holder)
    as_host(monkeypatch, "hostB")
    for name, value in rendezvous.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING):
        taken = Ownership.claim(directory, LOG)
    assert "the same run's process that owned it did not renew its lease for 0.3 s" in caplog.text
    taken.release()


def test_a_dead_pid_on_the_same_host_is_taken_at_once(file_system, monkeypatch, caplog):
    directory, pid = owner_killed_on_host_a(file_system, monkeypatch, "hostA")
    with caplog.at_level(logging.WARNING):
        taken = Ownership.claim(directory, LOG)
    assert f"pid {pid} is gone from hostA" in caplog.text
    assert read_owner(directory).pid == os.getpid()
    taken.release()


def test_contenders_for_an_expired_lease_one_wins(file_system):
    """Four hosts start together on a lease a dead host left: one owns, the others are refused
    naming it, in every round."""
    directory, patch = file_system
    gone = Owner(host="hostZ", pid=1, started="yesterday", beat=LONG_BEAT, token="gone")
    for round_ in range(3):
        (directory / OWNER).write_text(json.dumps(asdict(gone)))
        age(directory, 4 * LONG_BEAT)
        go = directory.parent / f"go-{round_}"
        contenders = [host_process(directory, f"host{i}", patch, wait_for=go) for i in range(4)]
        go.touch()
        try:
            first_lines = [c.stdout.readline().split(" ", 2) for c in contenders]
            winners = [line for line in first_lines if line[0] == "owned"]
            assert len(winners) == 1, first_lines
            winner = int(winners[0][1])
            refused = [line for line in first_lines if line[0] == "refused"]
            assert len(refused) == 3 and all(f"pid {winner} on host" in " ".join(line) for line in refused), first_lines
            assert read_owner(directory).pid == winner
        finally:
            for contender in contenders:
                contender.communicate("", timeout=30)
        assert read_owner(directory) is None
        assert sorted(p.name for p in directory.iterdir() if p.name != ".hvdtrain.lock") == []  # nothing left


def test_an_owner_that_lost_its_lease_is_told_and_saves_no_more(file_system, monkeypatch, caplog):
    """Paused (SIGSTOP) past its lease, the owner is taken over; resumed, its next beat tells it."""
    directory, patch = file_system
    holder = host_process(directory, "hostA", patch, beat=0.2, then=(
        "while held.lost is None: time.sleep(0.05)\n"
        "try:\n    held.check()\nexcept CheckpointError as error:\n    print('refused save:', error, flush=True)\n"))
    owned_by(holder)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        age(directory, 100)
        as_host(monkeypatch, "hostB")
        taken = Ownership.claim(directory, LOG, beat=LONG_BEAT)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    out, err = holder.communicate(timeout=60)
    assert out.startswith(f"refused save: checkpoint_dir {directory} is no longer this run's: pid {os.getpid()} "
                          f"on hostB, started "), out
    assert "took it over" in err and "writes no more checkpoints there" in err, err
    assert read_owner(directory).pid == os.getpid()  # the paused owner's end removed nothing
    taken.check()  # the new owner's own check passes
    taken.release()


def test_an_unwritable_directory_says_so_not_that_flock_is_missing(tmp_path, monkeypatch):
    real_open = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(OWNER) and flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, flags, *args)
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(CheckpointError, match=rf"checkpoint_dir {tmp_path} is not writable by this process "
                                              r"\(Read-only file system\).*mounted read-only") as refused:
        Ownership.claim(tmp_path, LOG)
    assert "flock" not in str(refused.value)


def test_the_lease_is_renewed_while_the_owner_lives(tmp_path):
    taken = Ownership.claim(tmp_path, LOG, beat=0.05)
    try:
        age(tmp_path, 1000)
        renewed = time.time() - 1000
        while os.stat(tmp_path / OWNER).st_mtime <= renewed + 500:  # the thread's next beat
            time.sleep(0.01)
        assert taken.lost is None
    finally:
        taken.release()


def test_a_save_of_a_run_whose_lease_was_taken_over_is_refused(tmp_path, monkeypatch):
    """Checkpointing's saves check the lease first: the run taken over writes nothing more there."""
    from types import SimpleNamespace

    from hvdtrain.checkpoint import coordination

    monkeypatch.setattr(coordination.collectives, "broadcast_object", lambda obj, root_rank, name: obj)
    config = SimpleNamespace(checkpoint_dir=str(tmp_path), keep_checkpoints=3, checkpoint_async=False)
    checkpoints = coordination.Checkpointing(config, SimpleNamespace(log=LOG, is_root=True), {})
    as_host(monkeypatch, "hostA")
    checkpoints.save({"step": 1}, 1)
    age(tmp_path, 1000)  # this process paused past its lease (its beat comes every 10 s)
    other = host_process(tmp_path, "hostB", "")
    try:
        owned_by(other)
        with pytest.raises(CheckpointError, match=rf"checkpoint_dir {tmp_path} is no longer this run's: "
                                                  rf"pid {other.pid} on hostB, started .* took it over"):
            checkpoints.save({"step": 2}, 2)
    finally:
        other.communicate("", timeout=30)
        checkpoints.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000001.pt", "ckpt-000000001.pt.checksum", "latest"]


def test_a_killed_owner_not_yet_reaped_is_gone_too(tmp_path, monkeypatch, caplog):
    """A zombie still answers kill(pid, 0): its state in /proc says it is gone."""
    holder = host_process(tmp_path, "hostA", "")
    pid = owned_by(holder)
    holder.send_signal(signal.SIGKILL)  # not waited for: a zombie until then
    while open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z":
        time.sleep(0.01)
    as_host(monkeypatch, "hostA")
    try:
        with caplog.at_level(logging.WARNING):
            taken = Ownership.claim(tmp_path, LOG)
        assert f"pid {pid} is gone from hostA" in caplog.text
        taken.release()
    finally:
        holder.wait(timeout=30)


def test_a_copy_of_a_directory_this_process_owns_is_taken_not_refused(tmp_path, caplog):
    """shutil.copytree keeps owner.json and its time: the copy names this live process with a fresh
    lease, yet this process holds no lease on the copy, so it is this process's to take."""
    import shutil

    held = Ownership.claim(tmp_path / "run", LOG)
    try:
        shutil.copytree(tmp_path / "run", tmp_path / "copy")
        with caplog.at_level(logging.WARNING):
            copy = Ownership.claim(tmp_path / "copy", LOG)
        assert "holds no lease there (a copied directory)" in caplog.text
        assert read_owner(tmp_path / "copy").token != read_owner(tmp_path / "run").token
        copy.release()
    finally:
        held.release()

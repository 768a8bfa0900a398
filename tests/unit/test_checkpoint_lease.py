"""The run lock of a checkpoint directory, a lease, on every file system's kind of flock.

Each host is a process with its own host name (ownership.host_name, replaced). The file systems
are simulated by what flock does there, in every process: nothing (ENOSYS: Lustre without
``-o flock``), a lock per node (it always succeeds: NFS ``local_lock``, Lustre ``localflock``,
BeeGFS), or a coherent lock that a dead host still holds (held forever by another process). The
lease uses no flock, so every case must come out the same on each. A lease expires on the taker's
own clock, from when it first saw the record: owners here renew every ``BEAT`` (0.2 s), so a dead
one is taken over 0.6 s after a taker first looks. A record's file times are never trusted: a
live owner whose clock lags (its renewals dated in the past, as on Lustre or GPFS, where a file's
times are its client's clock) is still live.
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
LONG_BEAT = 60.0  # an owner that renews no more during a test
BEAT = 0.2  # an owner that renews, and expires 0.6 s after a taker first looks
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


def host_process(directory, host, patch, then="sys.stdin.read()", beat=BEAT, env=None, wait_for=None):
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
    """The record dated ``seconds`` in the past: as its owner's clock would date it if it lagged."""
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
                                                  rf"renewed its lease while this run watched it.*another checkpoint_dir"):
            Ownership.claim(directory, LOG)
        assert read_owner(directory).pid == pid  # untouched
    finally:
        holder.communicate("", timeout=30)
    assert read_owner(directory) is None  # its end released it


def test_a_live_owner_whose_clock_lags_is_not_taken_over(file_system, monkeypatch):
    """Its renewals are dated 1000 s in the past (its host's clock lags; on Lustre and GPFS the file
    times are the client's): a taker reading the record's age would take a live run's directory."""
    directory, patch = file_system
    lagging = ("import os, time\n_utime = os.utime\n"
               "os.utime = lambda target, *a, **k: _utime(target, (time.time() - 1000,) * 2)\n")
    holder = host_process(directory, "hostA", patch + lagging)
    pid = owned_by(holder)
    age(directory, 1000)
    as_host(monkeypatch, "hostB")
    try:
        with pytest.raises(CheckpointError, match=rf"in use by a live run \(pid {pid} on hostA"):
            Ownership.claim(directory, LOG)
    finally:
        holder.communicate("", timeout=30)


def test_a_killed_owner_on_another_host_is_taken_over_once_its_lease_expired(file_system, monkeypatch, caplog):
    directory, pid = owner_killed_on_host_a(file_system, monkeypatch, "hostB")
    age(directory, -1000)  # dated in the future (a clock ahead): no longer a reason to wait
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        taken = Ownership.claim(directory, LOG)
    waited = time.monotonic() - started
    assert waited >= 3 * BEAT, f"taken after {waited:.2f} s, before the lease could expire"
    assert f"its previous owner (pid {pid} on hostA" in caplog.text
    assert "its lease was not renewed while this run watched it for 0.6 s" in caplog.text
    assert read_owner(directory).host == "hostB" and read_owner(directory).pid == os.getpid()
    taken.release()
    assert read_owner(directory) is None


def owner_killed_on_host_a(file_system, monkeypatch, then_as, env=None):
    """An owner on hostA (with ``env``) killed; this process then plays host ``then_as``. Returns
    the directory and the killed owner's pid."""
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


def test_a_requeue_of_the_same_slurm_job_takes_over_after_one_and_a_half_beats(file_system, monkeypatch, caplog):
    """A requeued job's previous instance is gone by SLURM's word, unless its node only stalled:
    1.5 of its beats without a renewal tell."""
    directory = after_slurm_job_4242_killed_on_host_a(file_system, monkeypatch, "4242")
    with caplog.at_level(logging.WARNING):
        taken = Ownership.claim(directory, LOG)
    assert "its lease was not renewed while this run watched it for 0.3 s" in caplog.text
    assert read_owner(directory).host == "hostB" and read_owner(directory).restart == 1
    taken.release()


def test_another_slurm_job_waits_for_the_whole_expiry(file_system, monkeypatch, caplog):
    directory = after_slurm_job_4242_killed_on_host_a(file_system, monkeypatch, "4243")
    with caplog.at_level(logging.WARNING):
        Ownership.claim(directory, LOG).release()
    assert "its previous owner (SLURM job 4242, pid" in caplog.text and "watched it for 0.6 s" in caplog.text


def test_the_same_run_in_another_process_takes_over_when_no_beat_comes(file_system, monkeypatch, caplog):
    """Horovod elastic's next rank 0 (another process of the same run, on another host) waits
    1.5 beats for the previous one's beat; it never comes from a killed process."""
    directory, patch = file_system
    rendezvous = {"HOROVOD_ELASTIC": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.1",
                  "HOROVOD_GLOO_RENDEZVOUS_PORT": "4711"}
    holder = host_process(directory, "hostA", patch, env=rendezvous)
    owned_by(holder)
    killed(holder)
    as_host(monkeypatch, "hostB")
    for name, value in rendezvous.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.WARNING):
        taken = Ownership.claim(directory, LOG)
    assert "its lease was not renewed while this run watched it for 0.3 s" in caplog.text
    taken.release()


def test_a_dead_pid_on_the_same_host_is_taken_at_once(file_system, monkeypatch, caplog):
    directory, pid = owner_killed_on_host_a(file_system, monkeypatch, "hostA")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        taken = Ownership.claim(directory, LOG)
    assert time.monotonic() - started < 3 * BEAT  # proven gone: nothing to wait for
    assert f"pid {pid} is gone from hostA" in caplog.text
    assert read_owner(directory).pid == os.getpid()
    taken.release()


def test_a_live_pid_on_the_same_host_is_refused_at_once(file_system, monkeypatch):
    directory, patch = file_system
    holder = host_process(directory, "hostA", patch, beat=LONG_BEAT)  # renews no more during the test
    pid = owned_by(holder)
    as_host(monkeypatch, "hostA")
    try:
        with pytest.raises(CheckpointError, match=rf"in use by a live run \(pid {pid} on hostA.*pid {pid} runs on "
                                                  r"this machine"):
            Ownership.claim(directory, LOG)
    finally:
        holder.communicate("", timeout=30)


def other_machine_of_the_same_name(monkeypatch, name):
    """This process as another machine that answers as ``name``: another kernel (boot id) and pid
    namespace, the same host name (a container with a fixed --hostname, an image left at localhost)."""
    as_host(monkeypatch, name)
    real = ownership._read_text
    monkeypatch.setattr(ownership, "_read_text", lambda path: "another-boot-id" if path.endswith("boot_id")
                        else real(path))
    monkeypatch.setattr(ownership, "_pid_namespace", lambda: "pid:[another]")


def test_two_machines_with_one_host_name_never_take_each_others_record_at_once(file_system, monkeypatch):
    """Another boot id under the same name used to read as a reboot of that host: taken at once,
    evicting a live run."""
    directory, patch = file_system
    holder = host_process(directory, "node1", patch)
    pid = owned_by(holder)
    other_machine_of_the_same_name(monkeypatch, "node1")
    try:
        with pytest.raises(CheckpointError, match=rf"in use by a live run \(pid {pid} on node1.*renewed its lease"):
            Ownership.claim(directory, LOG)
        assert read_owner(directory).pid == pid
    finally:
        holder.communicate("", timeout=30)


def test_a_killed_owner_on_a_machine_of_the_same_name_waits_for_its_expiry(file_system, monkeypatch, caplog):
    directory, pid = owner_killed_on_host_a(file_system, monkeypatch, "hostA")
    other_machine_of_the_same_name(monkeypatch, "hostA")
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        Ownership.claim(directory, LOG).release()
    assert time.monotonic() - started >= 3 * BEAT
    assert "watched it for 0.6 s" in caplog.text


def test_contenders_for_an_expired_lease_one_wins(file_system):
    """Four hosts start together on a lease a dead host left: one owns, the others are refused
    naming it, in every round."""
    directory, patch = file_system
    gone = Owner(host="hostZ", pid=1, started="yesterday", beat=BEAT, token="gone", generation=3)
    for round_ in range(3):
        (directory / OWNER).write_text(json.dumps(asdict(gone)))
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
            assert read_owner(directory).generation == 4  # one more than the record it took over
        finally:
            for contender in contenders:
                contender.communicate("", timeout=30)
        assert read_owner(directory) is None
        assert sorted(p.name for p in directory.iterdir() if p.name != ".hvdtrain.lock") == []  # nothing left


def test_an_owner_that_lost_its_lease_is_told_and_saves_no_more(file_system, monkeypatch, caplog):
    """Paused (SIGSTOP) past its lease, the owner is taken over; resumed, its next beat tells it."""
    directory, patch = file_system
    holder = host_process(directory, "hostA", patch, then=(
        "while held.lost is None: time.sleep(0.05)\n"
        "try:\n    held.fence()\nexcept CheckpointError as error:\n    print('refused save:', error, flush=True)\n"))
    owned_by(holder)
    os.kill(holder.pid, signal.SIGSTOP)
    try:
        as_host(monkeypatch, "hostB")
        taken = Ownership.claim(directory, LOG, beat=LONG_BEAT)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
    out, err = holder.communicate(timeout=60)
    assert out.startswith(f"refused save: checkpoint_dir {directory} is no longer this run's: pid {os.getpid()} "
                          f"on hostB, started "), out
    assert "took it over" in err and "writes no more checkpoints there" in err, err
    assert read_owner(directory).pid == os.getpid()  # the paused owner's end removed nothing
    taken.fence()  # the new owner's own fence passes
    taken.release()


def test_generations_count_claims(tmp_path, monkeypatch):
    """A claim's generation is one more than the record it takes over and than the directory's
    published checkpoints say (floor): a deposed owner's later checkpoint is older than its successor's."""
    first = Ownership.claim(tmp_path / "a", LOG)
    assert first.stamp["generation"] == 1 and first.stamp["token"] == read_owner(tmp_path / "a").token
    first.release()
    assert Ownership.claim(tmp_path / "a", LOG, floor=lambda: 7).stamp["generation"] == 8
    ownership._HELD[(tmp_path / "a").resolve()].release()
    gone = Owner(host="hostZ", pid=1, started="yesterday", beat=0.05, token="gone", generation=12)
    (tmp_path / "a" / OWNER).write_text(json.dumps(asdict(gone)))
    taken = Ownership.claim(tmp_path / "a", LOG, floor=lambda: 7)
    assert taken.stamp["generation"] == 13
    taken.release()


def test_a_dangling_owner_link_is_named_not_spun_on(tmp_path):
    (tmp_path / OWNER).symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(CheckpointError, match=rf"{tmp_path / OWNER} is a symbolic link \(to .*nowhere.json\).*Remove "
                                              r"the link"):
        Ownership.claim(tmp_path, LOG)


def test_an_owner_link_to_a_record_is_not_followed(tmp_path):
    (tmp_path / "elsewhere.json").write_text(json.dumps(asdict(Owner(host="x", pid=1, started="now", token="t"))))
    (tmp_path / OWNER).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(CheckpointError, match="is a symbolic link"):
        Ownership.claim(tmp_path, LOG)


def test_a_record_that_cannot_be_written_is_removed_not_left_empty(tmp_path, monkeypatch):
    """A full disk while the record is written: an empty record would make every later run wait
    for its expiry, unnamed."""
    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(CheckpointError, match=r"cannot write the owner record .*No space left on device.*Free space"):
        Ownership.claim(tmp_path, LOG)
    assert not (tmp_path / OWNER).exists()


def test_a_failed_renewal_refuses_the_save(tmp_path, monkeypatch):
    taken = Ownership.claim(tmp_path, LOG, beat=LONG_BEAT)
    try:
        real = os.utime

        def stale_handle(target, *args, **kwargs):
            raise OSError(errno.ESTALE, "Stale file handle")
        monkeypatch.setattr(os, "utime", stale_handle)
        with pytest.raises(CheckpointError, match=r"this run's lease could not be renewed \(Stale file handle\); no "
                                                  r"checkpoint is saved there until it is"):
            taken.fence()
        monkeypatch.setattr(os, "utime", real)
        taken.fence()  # renewed again: saves go on
    finally:
        taken.release()


@pytest.mark.parametrize("text", ["0", "-1", "soon", "nan", "inf"])
def test_a_lease_beat_that_is_no_duration_is_refused_naming_the_variable(tmp_path, monkeypatch, text):
    monkeypatch.setenv("HVDTRAIN_LEASE_BEAT", text)
    with pytest.raises(CheckpointError, match=rf"HVDTRAIN_LEASE_BEAT='{text}': it is the seconds between renewals"):
        Ownership.claim(tmp_path, LOG)


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
    monkeypatch.setenv("HVDTRAIN_LEASE_BEAT", str(BEAT))
    config = SimpleNamespace(checkpoint_dir=str(tmp_path), keep_checkpoints=3, checkpoint_async=False)
    checkpoints = coordination.Checkpointing(config, SimpleNamespace(log=LOG, is_root=True), {})
    as_host(monkeypatch, "hostA")
    checkpoints.save({"step": 1}, 1)
    checkpoints.ownership.beat = lambda: None  # this process paused past its lease: it renews no more
    other = host_process(tmp_path, "hostB", "")
    try:
        owned_by(other)
        del checkpoints.ownership.beat  # resumed
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

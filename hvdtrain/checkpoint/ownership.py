"""One live run per checkpoint directory: a lease, held through the owner record.

The run that writes a directory's checkpoints (its rank 0) owns ``owner.json`` in it: who it is
(SLURM job, host, pid, start time) and how often it renews its lease. No file lock is involved:
cluster file systems do not all give flock (Lustre without ``-o flock``), give it per node only
(NFS ``nolock``/``local_lock``, Lustre ``localflock``, BeeGFS by default: a second node gets it
too), or keep the lock of a dead node on the server (90 s on NFSv4, until a reboot on NFSv3).
Only operations every one of them makes atomic across hosts are used:

- **claim**: the record is created with ``O_EXCL``; of two runs, one creates it, the other finds it.
- **beat**: a background thread renews the lease every ``BEAT_SECONDS`` (10 s) by setting the
  record's modification time, through the file it opened and checked is still its own (never
  another run's). The same beat re-reads the record: when another run took the directory over
  (this process was paused or cut off from the file system for longer than its lease), the run
  is told: an error in its log, and its next checkpoint save is refused (``Ownership.check``).
- **take over**: a record found is judged (``judge``): the run is gone when its pid is gone on
  this host (or the host rebooted since), when this is a requeue of its SLURM job (a higher
  ``SLURM_RESTART_COUNT``: SLURM runs one instance of a job at a time), or when its lease expired
  (``EXPIRY_BEATS`` = 3 beats without renewal, so >= 2 beats missed; host clocks must agree to a
  few seconds, as NTP keeps them). The same run in another process (the same SLURM job, or
  Horovod elastic's next rank 0) waits ``SAME_RUN_BEATS`` (1.5 beats) for a beat and takes over
  when none came. Otherwise the run is refused, naming the owner. A gone owner's record is
  renamed aside (atomic: of several contenders one rename wins, the others find the record gone
  or another's, and check what they moved), then the new record is created with ``O_EXCL``.
- **release**: the record is removed (only while it is this run's), also when the process exits
  without releasing it (atexit); a killed process leaves it, for the next run to judge.

The age of a record is measured on the file system's clock where it has one (NFS sets times on
the server): a probe file's creation time against the record's last renewal.
"""
from __future__ import annotations

import atexit
import datetime
import errno
import json
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Dict, Optional, Tuple

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.common.atomic import fsync_directory

OWNER = "owner.json"
ASIDE = OWNER + ".gone-"  # + the token of the run that moved a gone owner's record aside
PROBE = ".hvdtrain-clock-"
BEAT_SECONDS = 10.0  # how often the owner renews its lease
EXPIRY_BEATS = 3.0  # another host takes over a record not renewed for this many beats
SAME_RUN_BEATS = 1.5  # the same run in another process waits this long for a beat
UNWRITTEN_RETRIES = 20  # reads of an empty record (a claim being written) before refusing unnamed
MISSING_RETRIES = 3  # reads of a missing record before the owner takes it as lost
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def host_name() -> str:
    """This host's name as the owner record gives it (tests give each process its own)."""
    return socket.gethostname()


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _pid_namespace() -> Optional[str]:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: str
    job: Optional[str] = None  # the SLURM job, when there is one
    restart: int = 0  # SLURM_RESTART_COUNT: a requeued job counts up
    elastic: Optional[str] = None  # Horovod elastic's rendezvous: the same for every rank 0 of one run
    boot: Optional[str] = None  # the kernel's boot id: another one on the same host means a reboot
    pid_namespace: Optional[str] = None  # a pid can be looked up only inside its own namespace
    beat: float = BEAT_SECONDS  # how often this owner renews its lease
    token: str = ""  # this claim's own id

    @classmethod
    def this_process(cls, beat: float = BEAT_SECONDS) -> "Owner":
        job = os.environ.get("SLURM_JOB_ID")
        if job and os.environ.get("SLURM_ARRAY_TASK_ID"):
            job = f"{os.environ.get('SLURM_ARRAY_JOB_ID', job)}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        elastic = None
        if os.environ.get("HOROVOD_ELASTIC") == "1" and os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"):
            elastic = (f"{os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:"
                       f"{os.environ.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}")
        try:
            restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
        except ValueError:
            restart = 0
        return cls(host=host_name(), pid=os.getpid(),
                   started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), job=job,
                   restart=restart, elastic=elastic, boot=_read_text("/proc/sys/kernel/random/boot_id"),
                   pid_namespace=_pid_namespace(), beat=beat, token=uuid.uuid4().hex)

    @classmethod
    def parse(cls, text: str) -> Optional["Owner"]:
        """The record in ``text``, or None (empty, as a claim is for an instant, or not a record).
        Fields of other versions are ignored; a record of the flock era has none of the lease's."""
        try:
            found = json.loads(text)
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in found.items() if k in known})
        except (ValueError, TypeError):
            return None

    def describe(self) -> str:
        job = f"SLURM job {self.job}, " if self.job else ""
        return f"{job}pid {self.pid} on {self.host}, started {self.started}"

    def same_machine(self, other: "Owner") -> bool:
        """Where ``other``'s pid means a process this one can look up."""
        return (self.host == other.host and self.boot is not None and self.boot == other.boot
                and self.pid_namespace is not None and self.pid_namespace == other.pid_namespace)

    def same_run(self, other: "Owner") -> bool:
        return bool((self.job and self.job == other.job) or (self.elastic and self.elastic == other.elastic))


@dataclass(frozen=True)
class Found:
    """A record as read: its owner (None when unreadable), its age in seconds since its last
    renewal, and what identifies that renewal (a change means the owner is alive)."""
    owner: Optional[Owner]
    age: float
    renewed: Tuple[int, int]  # (inode, mtime in ns)


def read_owner(directory: Path) -> Optional[Owner]:
    """The owner record in ``directory``, or None (absent or unreadable: said as 'no record')."""
    found = _read(Path(directory))
    return found.owner if found is not None else None


def _filesystem_now(directory: Path) -> float:
    """Now on the clock that sets the directory's file times (the server's, on NFS)."""
    path = directory / f"{PROBE}{uuid.uuid4().hex}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return time.time()
    try:
        return os.fstat(fd).st_mtime
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def _read(directory: Path) -> Optional[Found]:
    """The record now; opened, not stat'ed, so NFS revalidates its cached attributes."""
    try:
        with open(directory / OWNER) as handle:
            text, status = handle.read(), os.fstat(handle.fileno())
    except FileNotFoundError:
        return None
    return Found(Owner.parse(text), _filesystem_now(directory) - status.st_mtime,
                 (status.st_ino, status.st_mtime_ns))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    stat = _read_text(f"/proc/{pid}/stat")  # a killed process not yet reaped is a zombie: gone
    return not (stat and stat.rpartition(")")[2].split()[:1] == ["Z"])


TAKE, WAIT, REFUSE = "take", "wait", "refuse"


def judge(found: Found, me: Owner) -> Tuple[str, str]:
    """(TAKE, why the owner is gone), (WAIT, why: the same run, its next beat decides) or
    (REFUSE, why it is live) for the record ``found``, as seen by the would-be owner ``me``."""
    owner = found.owner
    beat = owner.beat if owner is not None else BEAT_SECONDS
    if owner is None:  # created, not yet written, or damaged: a lease like any other
        if found.age > EXPIRY_BEATS * beat:
            return TAKE, f"its unreadable owner record was not renewed for {found.age:.0f} s"
        return REFUSE, "its owner record is being written"
    if me.same_machine(owner) and owner.pid == me.pid:  # claim() found no lease of its own on it
        return TAKE, "the record names this process, which holds no lease there (a copied directory)"
    if me.same_machine(owner) and not _pid_alive(owner.pid):
        return TAKE, f"pid {owner.pid} is gone from {owner.host}"
    if not owner.token and owner.host == me.host:  # a flock-era record, never renewed: its pid decides
        if _pid_alive(owner.pid):
            return REFUSE, "a run of an earlier hvdtrain version, which holds it while its pid lives"
        return TAKE, f"pid {owner.pid} is gone from {owner.host}"
    if owner.host == me.host and owner.boot and me.boot and owner.boot != me.boot:
        return TAKE, f"{owner.host} rebooted since"
    if owner.job and owner.job == me.job and me.restart > owner.restart:
        return TAKE, f"this is SLURM job {me.job}'s requeue (restart {me.restart}, it ran as restart {owner.restart})"
    if found.age > EXPIRY_BEATS * beat:
        return TAKE, f"its lease expired: not renewed for {found.age:.0f} s (it renews every {beat:g} s)"
    if me.same_run(owner):
        return WAIT, "the same run in another process"
    return REFUSE, (f"its lease was renewed {max(found.age, 0):.0f} s ago; it renews every {beat:g} s, and "
                    f"expires {EXPIRY_BEATS * beat:g} s after its last renewal if that run is gone")


# The directories this process owns, with how many users (Trainers) hold each: a process runs its
# Trainers one after another, so a second Trainer in it on the same directory is the same owner.
_HELD: Dict[Path, "Ownership"] = {}


@atexit.register
def _release_at_exit() -> None:
    """A process that ends on its own (an exception included) lets its directories go; only a
    killed one leaves its record, for the next run to judge."""
    for held in list(_HELD.values()):
        held.users = 1
        held.release()


def _not_writable(directory: Path, error: OSError) -> CheckpointError:
    return CheckpointError(
        f"checkpoint_dir {directory} is not writable by this process ({error.strerror}): the run "
        f"cannot record itself as its owner, nor write checkpoints there. Give a checkpoint_dir this "
        f"user can write (check its permissions and that its file system is not mounted read-only)")


class Ownership:
    """This process's lease on one checkpoint directory, renewed by a background thread."""

    def __init__(self, directory: Path, owner: Owner, log) -> None:
        self.directory, self.owner, self.log = directory, owner, log
        self.users = 0
        self.lost: Optional[str] = None  # why this run no longer owns the directory
        self._stop = threading.Event()
        self._beating = threading.Lock()  # the thread's beat and a save's check, one at a time
        self._thread = threading.Thread(target=self._beat_until_released, name=f"hvdtrain-lease {directory}",
                                        daemon=True)

    @classmethod
    def claim(cls, directory: os.PathLike, log, beat: float = BEAT_SECONDS) -> "Ownership":
        """Own ``directory`` (created if needed) or raise CheckpointError naming its live owner.

        ``beat``: how often the lease is renewed (seconds; short in tests)."""
        directory = Path(directory).resolve()
        held = _HELD.get(directory)
        if held is None:
            held = cls._take(directory, log, beat)
            _HELD[directory] = held
            held._thread.start()
        held.users += 1
        return held

    @classmethod
    def _take(cls, directory: Path, log, beat: float) -> "Ownership":
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            if error.errno in NOT_WRITABLE:
                raise _not_writable(directory, error) from None
            raise CheckpointError(f"cannot create checkpoint_dir {directory}: {error}") from None
        me = Owner.this_process(beat)
        unwritten = 0
        while True:
            if cls._create(directory, me):
                return cls(directory, me, log)
            found = _read(directory)
            if found is None:
                continue  # released or moved aside meanwhile: try again
            verdict, why = judge(found, me)
            if found.owner is None and verdict == REFUSE and unwritten < UNWRITTEN_RETRIES:
                unwritten += 1  # created an instant ago, its content comes next: read it, to name it
                time.sleep(0.05)
                continue
            if verdict == WAIT:
                verdict, why = cls._wait_for_a_beat(directory, found, me)
            if verdict == REFUSE:
                owner = found.owner
                raise CheckpointError(
                    f"checkpoint_dir {directory} is in use by a live run "
                    f"({owner.describe() if owner else 'no owner record'}; {why}): two runs in one directory "
                    f"would resume and delete each other's checkpoints. Give this run another checkpoint_dir, "
                    f"or wait for that run to end")
            if verdict == TAKE and cls._move_aside(directory, found, me):
                previous = found.owner.describe() if found.owner else "no readable record"
                log.warning(f"checkpoint_dir {directory}: its previous owner ({previous}) ended without "
                            f"releasing it (killed, preempted or lost: {why}); this process takes it over")
            # Moved aside by this process or by another: the next round creates the record or meets
            # the other's.

    @staticmethod
    def _create(directory: Path, me: Owner) -> bool:
        """Create the record (True), or find one there (False)."""
        path = directory / OWNER
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError as error:
            if error.errno in NOT_WRITABLE:
                raise _not_writable(directory, error) from None
            raise CheckpointError(f"cannot create the owner record {path}: {error}") from None
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(me), handle)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_directory(directory)
        return True

    @staticmethod
    def _wait_for_a_beat(directory: Path, found: Found, me: Owner) -> Tuple[str, str]:
        """The same run's other process: gone when it does not renew within SAME_RUN_BEATS beats."""
        deadline = min(max(SAME_RUN_BEATS * found.owner.beat - found.age, 0.0), SAME_RUN_BEATS * found.owner.beat)
        waited = time.monotonic()
        while time.monotonic() - waited < deadline:
            time.sleep(min(found.owner.beat / 4, max(deadline - (time.monotonic() - waited), 0.01)))
            now = _read(directory)
            if now is None or now.renewed != found.renewed:
                return REFUSE, "the same run's process that owns it renewed its lease while this one waited"
        return TAKE, (f"the same run's process that owned it did not renew its lease for "
                      f"{SAME_RUN_BEATS * found.owner.beat:g} s")

    @staticmethod
    def _move_aside(directory: Path, found: Found, me: Owner) -> bool:
        """Rename the gone owner's record aside; True when the record moved is the one judged.
        Another contender may have replaced it between the read and the rename: that record is
        put back (with link, so it replaces nothing), and this contender meets it next round."""
        aside = directory / f"{ASIDE}{me.token}"
        try:
            os.rename(directory / OWNER, aside)
        except FileNotFoundError:
            return False
        except OSError as error:
            if error.errno in NOT_WRITABLE:
                raise _not_writable(directory, error) from None
            raise
        try:
            status = os.stat(aside)
            if (status.st_ino, status.st_mtime_ns) == found.renewed:
                return True
            try:
                os.link(aside, directory / OWNER)
            except FileExistsError:
                pass  # a third claim was made meanwhile; the owner put aside learns it at its beat
            except OSError:  # no hard links on this file system
                os.rename(aside, directory / OWNER)
            return False
        finally:
            aside.unlink(missing_ok=True)

    def _beat_until_released(self) -> None:
        while not self._stop.wait(self.owner.beat) and self.lost is None:
            self.beat()

    def beat(self) -> None:
        """Renew the lease, when the record is still this run's; else the run learns it lost it."""
        with self._beating:
            if self.lost is None:
                self._beat()

    def _beat(self) -> None:
        path = self.directory / OWNER
        for _ in range(MISSING_RETRIES):
            try:
                with open(path) as handle:
                    owner = Owner.parse(handle.read())
                    if owner is not None and owner.token == self.owner.token:
                        os.utime(handle.fileno())  # this very file: never another run's record
                        return
                break
            except FileNotFoundError:
                # A contender that moved it aside by mistake puts it back at once.
                owner = None
                time.sleep(self.owner.beat / 20)
            except OSError as error:  # a file system hiccup: the lease has EXPIRY_BEATS beats of slack
                self.log.warning(f"checkpoint_dir {self.directory}: could not renew this run's lease: {error}")
                return
        if self._stop.is_set():
            return
        self.lost = (f"checkpoint_dir {self.directory} is no longer this run's: "
                     + (f"{owner.describe()} took it over" if owner else "its owner record was removed or replaced")
                     + f": it judged this run gone (another host does so {EXPIRY_BEATS * self.owner.beat:g} s after "
                       f"the last renewal: was this process paused, or cut off from the file system?). This run "
                       f"writes no more checkpoints there: stop it, and resume from that directory in one run only")
        self.log.error(self.lost)

    def check(self) -> None:
        """Raise CheckpointError when this run no longer owns the directory (before a save)."""
        self.beat()
        if self.lost is not None:
            raise CheckpointError(self.lost)

    def release(self) -> None:
        """One user fewer; the last one stops renewing and removes the owner record (while it is
        this run's) and lets the directory go."""
        self.users -= 1
        if self.users > 0 or _HELD.get(self.directory) is not self:
            return
        del _HELD[self.directory]
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.owner.beat + 5)
        found = _read(self.directory)
        if found is not None and found.owner is not None and found.owner.token == self.owner.token:
            (self.directory / OWNER).unlink(missing_ok=True)

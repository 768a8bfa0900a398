"""One live run per checkpoint directory: a lease, held through the owner record, and fencing.

The run that writes a directory's checkpoints (its rank 0) owns ``owner.json`` in it: who it is
(SLURM job, host, pid, start time), how often it renews its lease, and its claim's token and
generation. No file lock is involved: cluster file systems do not all give flock (Lustre without
``-o flock``), give it per node only (NFS ``nolock``/``local_lock``, Lustre ``localflock``, BeeGFS
by default: a second node gets it too), or keep the lock of a dead node on the server (90 s on
NFSv4, until a reboot on NFSv3). Only operations every one of them makes atomic across hosts are
used, and no clock is compared with another host's:

- **claim**: the record is created with ``O_EXCL``; of two runs, one creates it, the other finds it.
  Each claim's generation is one more than any before it in the directory (the record it takes over,
  the checkpoints published there: ``floor``).
- **beat**: a background thread renews the lease every ``BEAT_SECONDS`` (10 s) by setting the
  record's modification time, through the file it opened and checked is still its own (never
  another run's). The same beat re-reads the record: when another run took the directory over
  (this process was paused or cut off from the file system for longer than its lease), the run
  is told: an error in its log, and every save from then on is refused (``fence``).
- **take over**: a record found is judged (``judge``). Its owner is gone at once only when its pid
  is proven gone on this very kernel (same host name, boot id and pid namespace). The same run in
  another process (the same SLURM job, a requeue included, or Horovod elastic's next rank 0) is
  watched for ``SAME_RUN_BEATS`` (1.5 beats); any other owner for ``EXPIRY_BEATS`` (3 beats), on
  this process's own monotonic clock: a record not renewed for that long is taken over, one renewed
  meanwhile refuses the run, naming its owner. Host clocks need not agree (on Lustre and GPFS a
  file's times are its client's clock), and two machines with one host name (containers with a
  fixed ``--hostname``) are told apart by their boot ids but never take each other's record at
  once. A gone owner's record is renamed aside (atomic: of several contenders one rename wins,
  the others find the record gone or another's, and check what they moved), then the new record
  is created with ``O_EXCL``.
- **fence**: before each irreversible step of a save (a rename into place, ``latest``, a prune,
  the compile cache), the lease is renewed and checked to be still this run's; a renewal that
  fails refuses the save. What a save publishes carries the claim's ``stamp`` (generation and
  token): a checkpoint published by an owner deposed between its last check and its rename (a
  process stopped at that very instant) has an older generation than a checkpoint of an earlier
  step, and a resume sets it aside (hvdtrain.checkpoint.formats.full).
- **release**: the record is removed (only while it is this run's), also when the process exits
  without releasing it (atexit), within a bound (a hung file system does not hold the exit); a
  killed process leaves it, for the next run to judge.
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import errno
import json
import math
import os
import socket
import threading
import time
import uuid
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.common import io_watch
from hvdtrain.common.atomic import fsync_directory

OWNER = "owner.json"
ASIDE = OWNER + ".gone-"  # + the token of the run that moved a gone owner's record aside
BEAT_SECONDS = 10.0  # how often the owner renews its lease, unless HVDTRAIN_LEASE_BEAT says otherwise
BEAT_VARIABLE = "HVDTRAIN_LEASE_BEAT"
EXPIRY_BEATS = 3.0  # a record seen unrenewed for this many beats is taken over
SAME_RUN_BEATS = 1.5  # the same run in another process: seen unrenewed this long
MISSING_RETRIES = 3  # reads of a missing record (or creations finding one) before naming the cause
RELEASE_SECONDS = 5.0  # how long an exit waits for the file system to remove the record
NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


def lease_beat(environ=os.environ) -> float:
    """Seconds between renewals of a lease this process claims: HVDTRAIN_LEASE_BEAT, else
    BEAT_SECONDS. A shorter beat makes a takeover after a crash quicker (3 beats) and costs a
    renewal (an open and a utime of the record) per beat."""
    text = environ.get(BEAT_VARIABLE, "")
    if not text:
        return BEAT_SECONDS
    try:
        beat = float(text)
    except ValueError:
        beat = math.nan
    if not (math.isfinite(beat) and beat > 0):
        raise CheckpointError(f"{BEAT_VARIABLE}={text!r}: it is the seconds between renewals of the checkpoint "
                              f"directory's lease, a number > 0 (default {BEAT_SECONDS:g}); unset it for the default")
    return beat


def host_name() -> str:
    """This host's name as the owner record gives it (tests give each process its own)."""
    return socket.gethostname()


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as handle:
            return handle.read().strip()
    except OSError:
        return None


def _process_started(pid: "int | str") -> Optional[int]:
    """When the process ``pid`` started, in clock ticks since boot (/proc/PID/stat's 22nd field):
    with the pid, a process no other ever is (a pid is reused, never with its start time)."""
    stat = _read_text(f"/proc/{pid}/stat")
    try:
        return int(stat.rpartition(")")[2].split()[19]) if stat else None
    except (IndexError, ValueError):
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
    boot: Optional[str] = None  # the kernel's boot id: with the host name and pid namespace, which kernel
    pid_namespace: Optional[str] = None  # a pid can be looked up only inside its own namespace
    beat: float = BEAT_SECONDS  # how often this owner renews its lease
    token: str = ""  # this claim's own id
    generation: int = 0  # one more than every claim before it in the directory (0: written before generations)
    pid_started: Optional[int] = None  # the pid's start time (ticks since boot): a live pid is this very process

    @classmethod
    def this_process(cls, beat: float = BEAT_SECONDS, generation: int = 1) -> "Owner":
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
                   pid_namespace=_pid_namespace(), beat=beat, token=uuid.uuid4().hex, generation=generation,
                   pid_started=_process_started("self"))

    @classmethod
    def parse(cls, text: str) -> Optional["Owner"]:
        """The record in ``text``, or None (empty, as a claim is for an instant, or not a record).
        Fields of other versions are ignored; a record of the flock era has none of the lease's."""
        try:
            found = json.loads(text)
            known = {f.name for f in fields(cls)}
            owner = cls(**{k: v for k, v in found.items() if k in known})
        except (ValueError, TypeError):
            return None
        valid_beat = isinstance(owner.beat, (int, float)) and not isinstance(owner.beat, bool) and owner.beat > 0
        return owner if valid_beat and isinstance(owner.generation, int) and isinstance(owner.pid, int) else None

    def describe(self) -> str:
        job = f"SLURM job {self.job}, " if self.job else ""
        return f"{job}pid {self.pid} on {self.host}, started {self.started}"

    def same_machine(self, other: "Owner") -> bool:
        """Where ``other``'s pid means a process this one can look up: the same kernel (boot id),
        the same pid namespace, and the same host name."""
        return (self.host == other.host and self.boot is not None and self.boot == other.boot
                and self.pid_namespace is not None and self.pid_namespace == other.pid_namespace)

    def same_run(self, other: "Owner") -> bool:
        return bool((self.job and self.job == other.job) or (self.elastic and self.elastic == other.elastic))

    @property
    def stamp(self) -> Dict[str, Any]:
        """What a save publishes of the claim it was made under (fencing)."""
        return {"generation": self.generation, "token": self.token}


@dataclass(frozen=True)
class Found:
    """A record as read: its owner (None when unreadable) and what identifies its last renewal
    (a change means its owner is alive, or another record replaced it)."""
    owner: Optional[Owner]
    renewed: Tuple[int, int, int]  # (inode, mtime in ns, ctime in ns)


def read_owner(directory: Path) -> Optional[Owner]:
    """The owner record in ``directory``, or None (absent or unreadable: said as 'no record')."""
    found = _read(Path(directory))
    return found.owner if found is not None else None


def _symlink_error(path: Path) -> CheckpointError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return CheckpointError(f"{path} is a symbolic link (to {target}): hvdtrain keeps its run's owner record there as "
                           f"a regular file, and will not follow a link. Remove the link (no run of hvdtrain made it)")


def _read(directory: Path) -> Optional[Found]:
    """The record now, or None when there is none; opened, not stat'ed, so NFS revalidates its
    cached attributes; never through a symbolic link (CheckpointError)."""
    path = directory / OWNER
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _symlink_error(path) from None
        raise
    with os.fdopen(fd) as handle:
        text, status = handle.read(), os.fstat(fd)
    return Found(Owner.parse(text), (status.st_ino, status.st_mtime_ns, status.st_ctime_ns))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    stat = _read_text(f"/proc/{pid}/stat")  # a killed process not yet reaped is a zombie: gone
    return not (stat and stat.rpartition(")")[2].split()[:1] == ["Z"])


TAKE, WAIT, WATCH, REFUSE = "take", "wait", "watch", "refuse"


def judge(found: Found, me: Owner) -> Tuple[str, str]:
    """What the would-be owner ``me`` does about the record ``found``: (TAKE, why its owner is
    proven gone), (WAIT, why: the same run, SAME_RUN_BEATS decide), (WATCH, why: another run,
    EXPIRY_BEATS decide) or (REFUSE, why it is live). Proof either way comes from this kernel only:
    the owner's pid looked up where it means the same process (same_machine)."""
    owner = found.owner
    if owner is None:  # created, not yet written, or damaged: a lease like any other
        return WATCH, "its owner record is unreadable (being written, or damaged)"
    if me.same_machine(owner) and owner.pid == me.pid:  # claim() found no lease of its own on it
        return TAKE, "the record names this process, which holds no lease there (a copied directory)"
    if me.same_machine(owner):
        if not _pid_alive(owner.pid):
            return TAKE, f"pid {owner.pid} is gone from {owner.host}"
        started = _process_started(owner.pid)
        if owner.pid_started is not None and started is not None:
            if started != owner.pid_started:
                return TAKE, f"pid {owner.pid} is gone from {owner.host} (another process has its number now)"
            return REFUSE, f"pid {owner.pid} runs on this machine"
    if not owner.token and owner.host == me.host and _pid_alive(owner.pid):
        # A flock-era record is never renewed: while a process of its pid lives here, it may be that run.
        return REFUSE, "a run of an earlier hvdtrain version, which holds it while its pid lives"
    if me.same_run(owner):
        return WAIT, "the same run in another process"
    return WATCH, "another run's"


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


def _in_use(directory: Path, owner: Optional[Owner], why: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint_dir {directory} is in use by a live run "
        f"({owner.describe() if owner else 'no owner record'}; {why}): two runs in one directory "
        f"would resume and delete each other's checkpoints. Give this run another checkpoint_dir, "
        f"or wait for that run to end")


class Ownership:
    """This process's lease on one checkpoint directory, renewed by a background thread."""

    def __init__(self, directory: Path, owner: Owner, log) -> None:
        self.directory, self.owner, self.log = directory, owner, log
        self.users = 0
        self.lost: Optional[str] = None  # why this run no longer owns the directory
        self._stop = threading.Event()
        self._beating = threading.Lock()  # the thread's beat and a save's fence, one at a time
        self._thread = threading.Thread(target=self._beat_until_released, name=f"hvdtrain-lease {directory}",
                                        daemon=True)

    @classmethod
    def claim(cls, directory: os.PathLike, log, beat: Optional[float] = None,
              floor: Callable[[], int] = lambda: 0) -> "Ownership":
        """Own ``directory`` (created if needed) or raise CheckpointError naming its live owner.

        Args:
            directory: the checkpoint directory.
            log: where a takeover and a wait are said.
            beat: how often the lease is renewed (seconds); None: lease_beat().
            floor: the highest generation the directory's published checkpoints carry (read when
                the record is created: this claim's generation is one more than it and than the
                record it takes over).
        """
        directory = Path(directory).resolve()
        held = _HELD.get(directory)
        if held is None:
            with io_watch.watching(directory / OWNER, "lease claim"):
                held = cls._take(directory, log, lease_beat() if beat is None else beat, floor)
            _HELD[directory] = held
            held._thread.start()
        held.users += 1
        return held

    @classmethod
    def _take(cls, directory: Path, log, beat: float, floor: Callable[[], int]) -> "Ownership":
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            if error.errno in NOT_WRITABLE:
                raise _not_writable(directory, error) from None
            raise CheckpointError(f"cannot create checkpoint_dir {directory}: {error}") from None
        me = Owner.this_process(beat)
        seen_before = 0  # generation of the records judged so far
        vanished = 0  # rounds where the record could be neither created nor read
        while True:
            me = dataclasses.replace(me, generation=max(floor(), seen_before) + 1)
            if cls._create(directory, me):
                return cls(directory, me, log)
            found = _read(directory)
            io_watch.progress()
            if found is None:  # released or moved aside meanwhile: try again, a few times
                vanished += 1
                if vanished > MISSING_RETRIES:
                    raise cls._neither_created_nor_read(directory)
                continue
            vanished = 0
            if found.owner is not None:
                seen_before = max(seen_before, found.owner.generation)
            verdict, why = judge(found, me)
            if verdict == WAIT:
                verdict, why = cls._watch(directory, found, SAME_RUN_BEATS, log, why)
            elif verdict == WATCH:
                verdict, why = cls._watch(directory, found, EXPIRY_BEATS, log, why)
            if verdict == REFUSE:
                raise _in_use(directory, found.owner, why)
            if verdict == TAKE and cls._move_aside(directory, found, me):
                previous = found.owner.describe() if found.owner else "no readable record"
                log.warning(f"checkpoint_dir {directory}: its previous owner ({previous}) ended without "
                            f"releasing it (killed, preempted or lost: {why}); this process takes it over")
            # Moved aside by this process or by another, or replaced meanwhile: the next round
            # creates the record or meets the other's.

    @staticmethod
    def _neither_created_nor_read(directory: Path) -> CheckpointError:
        path = directory / OWNER
        if os.path.islink(path):
            return _symlink_error(path)
        return CheckpointError(f"{path} can be neither created (it exists) nor read (it does not): the file system "
                               f"of checkpoint_dir {directory} disagrees with itself. Check it (a stale NFS handle "
                               f"clears on a remount), or give this run another checkpoint_dir")

    @staticmethod
    def _create(directory: Path, me: Owner) -> bool:
        """Create the record (True), or find one there (False). A record whose writing fails (a
        full disk) is removed, never left empty for the next run to wait out."""
        path = directory / OWNER
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        except OSError as error:
            if error.errno in NOT_WRITABLE:
                raise _not_writable(directory, error) from None
            raise CheckpointError(f"cannot create the owner record {path}: {error}") from None
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(asdict(me), handle)
                handle.flush()
                os.fsync(handle.fileno())
            fsync_directory(directory)
        except OSError as error:
            path.unlink(missing_ok=True)  # created by this O_EXCL: this run's to remove
            raise CheckpointError(f"cannot write the owner record {path} ({error.strerror or error}): the run cannot "
                                  f"record itself as its owner. Free space on that file system (checkpoints need it "
                                  f"too), or give this run another checkpoint_dir") from None
        return True

    @staticmethod
    def _watch(directory: Path, found: Found, beats: float, log, why: str) -> Tuple[str, str]:
        """Watch the record ``found`` for ``beats`` of its owner's beats on this process's monotonic
        clock: (TAKE, why) when it was never renewed, (REFUSE, why) when its owner renewed it,
        (WATCH, why) when another record replaced it (judged anew)."""
        owner = found.owner
        beat = owner.beat if owner is not None else BEAT_SECONDS
        limit = beats * beat
        if limit >= 5:
            log.info(f"checkpoint_dir {directory} holds the record of "
                     f"{owner.describe() if owner else 'an owner not named (unreadable record)'} ({why}): watching it "
                     f"up to {limit:g} s for a renewal before taking it over")
        started = time.monotonic()
        while True:
            left = limit - (time.monotonic() - started)
            if left <= 0:
                return TAKE, (f"its lease was not renewed while this run watched it for {limit:g} s "
                              f"({beats:g} of its beats of {beat:g} s)")
            time.sleep(min(beat / 4, left))
            now = _read(directory)
            io_watch.progress()
            if now is None or now.owner != owner:
                return WATCH, "replaced while this run watched it"
            if now.renewed != found.renewed:
                return REFUSE, (f"it renewed its lease while this run watched it (it renews every {beat:g} s; "
                                f"a run gone stops renewing, and is taken over {EXPIRY_BEATS * beat:g} s later)")

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
            status = os.stat(aside, follow_symlinks=False)
            if (status.st_ino, status.st_mtime_ns, status.st_ctime_ns)[:2] == found.renewed[:2]:
                return True
            try:
                os.link(aside, directory / OWNER, follow_symlinks=False)
            except FileExistsError:
                pass  # a third claim was made meanwhile; the owner put aside learns it at its beat
            except OSError:  # no hard links on this file system
                os.rename(aside, directory / OWNER)
            return False
        finally:
            aside.unlink(missing_ok=True)

    @property
    def stamp(self) -> Dict[str, Any]:
        """What every save under this lease publishes (fencing: module text)."""
        return self.owner.stamp

    def _beat_until_released(self) -> None:
        while not self._stop.wait(self.owner.beat) and self.lost is None:
            try:
                self.beat()
            except CheckpointError as error:  # a renewal that failed: the next save is refused
                self.log.warning(str(error))

    def beat(self) -> None:
        """Renew the lease, when the record is still this run's; else the run learns it lost it.
        CheckpointError when the renewal failed (the file system did not answer as asked)."""
        with self._beating, io_watch.watching(self.directory / OWNER, "lease renewal"):
            if self.lost is None:
                self._beat()

    def _beat(self) -> None:
        path = self.directory / OWNER
        owner = None
        for _ in range(MISSING_RETRIES):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                with os.fdopen(fd) as handle:
                    owner = Owner.parse(handle.read())
                    if owner is not None and owner.token == self.owner.token:
                        os.utime(handle.fileno())  # this very file: never another run's record
                        return
                break
            except FileNotFoundError:
                # A contender that moved it aside by mistake puts it back at once.
                owner = None
                time.sleep(self.owner.beat / 20)
            except OSError as error:
                if error.errno == errno.ELOOP:  # replaced by a link: not this run's record any more
                    break
                raise CheckpointError(f"checkpoint_dir {self.directory}: this run's lease could not be renewed "
                                      f"({error.strerror or error}); no checkpoint is saved there until it is "
                                      f"(another host takes over a lease not renewed for "
                                      f"{EXPIRY_BEATS * self.owner.beat:g} s)") from None
        if self._stop.is_set():
            return
        self.lost = (f"checkpoint_dir {self.directory} is no longer this run's: "
                     + (f"{owner.describe()} took it over" if owner else "its owner record was removed or replaced")
                     + f": it judged this run gone (another host does so when it sees no renewal for "
                       f"{EXPIRY_BEATS * self.owner.beat:g} s: was this process paused, or cut off from the file "
                       f"system?). This run writes no more checkpoints there: stop it, and resume from that "
                       f"directory in one run only")
        self.log.error(self.lost)

    def fence(self) -> None:
        """Right before an irreversible step of a save: the lease renewed now, and still this
        run's; else CheckpointError (the save is refused, nothing is published)."""
        self.beat()
        if self.lost is not None:
            raise CheckpointError(self.lost)

    def release(self) -> None:
        """One user fewer; the last one stops renewing and removes the owner record (while it is
        this run's) and lets the directory go; a file system that does not answer within
        RELEASE_SECONDS is left to the next run, which takes the lease over once it expires."""
        self.users -= 1
        if self.users > 0 or _HELD.get(self.directory) is not self:
            return
        del _HELD[self.directory]
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=min(self.owner.beat, RELEASE_SECONDS))
        remover = threading.Thread(target=self._remove_record, name=f"hvdtrain-release {self.directory}", daemon=True)
        remover.start()
        remover.join(RELEASE_SECONDS)
        if remover.is_alive():
            self.log.warning(f"checkpoint_dir {self.directory}: its owner record could not be removed within "
                             f"{RELEASE_SECONDS:g} s (the file system does not answer); the next run takes it over "
                             f"once it expires ({EXPIRY_BEATS * self.owner.beat:g} s)")

    def _remove_record(self) -> None:
        try:
            found = _read(self.directory)
            if found is not None and found.owner is not None and found.owner.token == self.owner.token:
                (self.directory / OWNER).unlink(missing_ok=True)
        except (OSError, CheckpointError):
            pass  # left for the next run to judge

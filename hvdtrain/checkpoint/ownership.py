"""One live run per checkpoint directory.

The run that writes a directory's checkpoints holds an exclusive lock on ``.hvdtrain.lock`` in it
and records itself in ``owner.json`` (job, host, pid, start time) while it lives. The lock is the
kernel's (flock): it goes with the process that held it, however that process ended, so a killed
run never leaves a lock behind; its ``owner.json`` stays and the next run reports it and takes
over. A second live run on the same directory is refused, naming the owner. On NFS, Linux emulates
flock with POSIX locks, so the lock holds across hosts; Lustre needs its ``flock`` mount option.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, Optional

import filelock

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.common.atomic import fsync_directory

LOCK = ".hvdtrain.lock"
OWNER = "owner.json"


@dataclass(frozen=True)
class Owner:
    host: str
    pid: int
    started: str
    job: Optional[str] = None  # the SLURM job, when there is one

    @classmethod
    def this_process(cls) -> "Owner":
        job = os.environ.get("SLURM_JOB_ID")
        if job and os.environ.get("SLURM_ARRAY_TASK_ID"):
            job = f"{os.environ.get('SLURM_ARRAY_JOB_ID', job)}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        return cls(host=socket.gethostname(), pid=os.getpid(),
                   started=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), job=job)

    def describe(self) -> str:
        job = f"SLURM job {self.job}, " if self.job else ""
        return f"{job}pid {self.pid} on {self.host}, started {self.started}"


def read_owner(directory: Path) -> Optional[Owner]:
    """The owner record in ``directory``, or None (absent or unreadable: said as 'no record')."""
    try:
        return Owner(**json.loads((Path(directory) / OWNER).read_text()))
    except (OSError, ValueError, TypeError):
        return None


# The directories this process owns, with how many users (Trainers) hold each: a process runs its
# Trainers one after another, so a second Trainer in it on the same directory is the same owner.
_HELD: Dict[Path, "Ownership"] = {}


class Ownership:
    """This process's claim on one checkpoint directory."""

    def __init__(self, directory: Path, lock: filelock.BaseFileLock, owner: Owner) -> None:
        self.directory, self._lock, self.owner = directory, lock, owner
        self.users = 0

    @classmethod
    def claim(cls, directory: os.PathLike, log) -> "Ownership":
        """Own ``directory`` (created if needed) or raise CheckpointError naming its live owner."""
        directory = Path(directory).resolve()
        held = _HELD.get(directory)
        if held is None:
            held = _HELD[directory] = cls._take(directory, log)
        held.users += 1
        return held

    @classmethod
    def _take(cls, directory: Path, log) -> "Ownership":
        directory.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(directory / LOCK, timeout=0)
        try:
            lock.acquire()
        except filelock.Timeout:
            owner = read_owner(directory)
            raise CheckpointError(
                f"checkpoint_dir {directory} is in use by a live run ({owner.describe() if owner else 'no owner record'}): "
                f"two runs in one directory would resume and delete each other's checkpoints. Give this run "
                f"another checkpoint_dir, or wait for that run to end") from None
        except OSError as error:
            raise CheckpointError(
                f"cannot lock checkpoint_dir {directory} ({error}): its file system refuses file locks "
                f"(Lustre: mount it with -o flock); put the checkpoints on a file system that takes them") from None
        previous = read_owner(directory)
        if previous is not None:
            log.warning(f"checkpoint_dir {directory}: its previous owner ({previous.describe()}) ended without "
                        f"releasing it (killed, preempted or lost); this process takes it over")
        owner = Owner.this_process()
        path = directory / OWNER
        path.unlink(missing_ok=True)
        # Exclusive: with the lock held no other run writes here, and O_EXCL makes sure of it.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        with os.fdopen(fd, "w") as handle:
            json.dump(asdict(owner), handle)
            handle.flush()
            os.fsync(handle.fileno())
        fsync_directory(directory)
        return cls(directory, lock, owner)

    def release(self) -> None:
        """One user fewer; the last one removes the owner record and lets the directory go."""
        self.users -= 1
        if self.users > 0 or _HELD.get(self.directory) is not self:
            return
        del _HELD[self.directory]
        (self.directory / OWNER).unlink(missing_ok=True)
        self._lock.release()

"""Writing a rank's flight record into the run directory, and what asks for it.

    RUN_DIR/flight/
      rank-00003.json         rank 3's last dump: its collectives, phases and threads' stacks
      alive/rank-00003.json   rank 3 runs now (host, pid): what `hvdtrain debug dump` waits for
      request                 `hvdtrain debug dump` writes a new token here; every rank dumps

Three things make a rank dump: the stall watchdog (hvdtrain.fault_tolerance.watchdog), SIGUSR2,
and the request file, which reaches ranks on every host through the shared run directory. The
last two are served by one daemon thread per rank, so that a rank whose main thread hangs inside
a collective (in C, where no Python signal handler runs) still answers: SIGUSR2's C-level handler
writes to Python's wakeup fd, which this thread reads; between signals it looks for a request every
``POLL_SECONDS``. Only one rank per host (its local rank 0) reads the request file on the shared
file system; it copies a new token into a file in the host's memory (``host_mailbox``: /dev/shm,
which the ranks of a host share, as NCCL's shared-memory transport needs them to), where the
host's other ranks look: the file system's metadata server sees one reader per host, not one per
rank. A request reaches every rank within two polls. The stacks come from sys._current_frames():
the main thread's, where it hangs, included.
"""
from __future__ import annotations

import hashlib
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from hvdtrain.common.atomic import write_text_atomically
from hvdtrain.common.flight.recorder import RECORDER, FlightRecorder

FLIGHT_DIR = "flight"
REQUEST_FILE = "request"
ALIVE_DIR = "alive"
FORMAT = "hvdtrain-flight/1"
POLL_SECONDS = 2.0
DUMP_SIGNAL = "USR2"
HOST_MEMORY = Path("/dev/shm")  # where a host's ranks find the request's token (the temp directory without it)


def flight_directory(run_dir: Path) -> Path:
    return Path(run_dir) / FLIGHT_DIR


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / f"rank-{rank:05d}.json"


def thread_stacks() -> Dict[str, List[str]]:
    """Every thread's Python stack, innermost call last, by "name (ident)"."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return {f"{names.get(ident, 'unknown')} ({ident})": traceback.format_stack(frame)
            for ident, frame in sys._current_frames().items()}


def write_dump(directory: Path, rank: int, size: Optional[int], reason: str, recorder: FlightRecorder = RECORDER,
               describe_process_set: Callable[[Any], Optional[List[int]]] = lambda key: None,
               extra: Optional[Dict[str, Any]] = None) -> Path:
    """This rank's record and stacks as ``directory``/rank-NNNNN.json (whole or not at all); its path.

    Args:
        directory: the run directory's flight/.
        rank: this rank.
        size: the ranks of the job (None: not known).
        reason: why it was written (stall, SIGUSR2, request), for the reader.
        recorder: whose entries.
        describe_process_set: a process set's ranks, by its id (None: every rank).
        extra: more values for the reader (the step, the token of a request).
    """
    record = {"format": FORMAT, "rank": rank, "size": size, "host": socket.gethostname(), "pid": os.getpid(),
              "written": time.time(), "reason": reason, **(extra or {}),
              **recorder.snapshot(describe_process_set), "stacks": thread_stacks()}
    path = rank_file(directory, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(record, indent=1))
    return path


def request_dump(run_dir: Path) -> str:
    """Ask every rank of the run in ``run_dir`` to dump (they look every POLL_SECONDS): the request's token."""
    token = f"{time.time():.6f}-{os.getpid()}"
    directory = flight_directory(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    write_text_atomically(directory / REQUEST_FILE, token)
    return token


def read_token(directory: Path) -> Optional[str]:
    try:
        return (Path(directory) / REQUEST_FILE).read_text().strip()
    except OSError:
        return None


def host_mailbox(directory: Path, host_directory: Optional[Path] = None) -> Path:
    """The file through which the local rank 0 hands a request for the run's ``directory`` (its
    flight/) to the other ranks of its host: in ``host_directory`` (default: /dev/shm, else the temp
    directory), named after this user and the directory's real path, the same for every rank of the host."""
    base = host_directory or (HOST_MEMORY if HOST_MEMORY.is_dir() else Path(tempfile.gettempdir()))
    key = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:16]
    return Path(base) / f"hvdtrain-{os.getuid()}-flight-request-{key}"


def post_token(mailbox: Path, token: str) -> None:
    """``token`` into the host's mailbox, whole (a reader sees the old token or the new)."""
    temporary = mailbox.with_name(f".{mailbox.name}.{os.getpid()}")
    temporary.write_text(token)
    os.replace(temporary, mailbox)


def read_posted_token(mailbox: Path) -> Optional[str]:
    try:
        return mailbox.read_text().strip()
    except OSError:
        return None


def alive_ranks(directory: Path) -> Dict[int, Dict[str, Any]]:
    """The ranks that announced themselves (rank -> host, pid) and have not left."""
    found = {}
    for path in sorted((Path(directory) / ALIVE_DIR).glob("rank-*.json")):
        try:
            entry = json.loads(path.read_text())
            found[int(entry["rank"])] = entry
        except (OSError, ValueError, KeyError):
            continue  # being written, or not ours
    return found


class DumpService:
    """One rank's answer to SIGUSR2 and to ``hvdtrain debug dump`` (see the module's text).

    Args:
        directory: the run directory's flight/.
        rank: this rank.
        size: the ranks of the job.
        signal_name: the signal that dumps ("" or None: none; one another part of hvdtrain owns).
        dump: ``dump(reason, extra)`` writes this rank's file (write_dump with the job's facts).
        local_rank: this rank's place on its host: 0 reads the request file and posts a new token
            to the host's mailbox; the others read the mailbox.
        host_directory: where the host's mailbox is (host_mailbox; None: /dev/shm).
    """

    def __init__(self, directory: Path, rank: int, size: int, signal_name: Optional[str],
                 dump: Callable[[str, Dict[str, Any]], Path], local_rank: int = 0,
                 host_directory: Optional[Path] = None) -> None:
        self.directory, self.rank, self.size, self._dump = Path(directory), rank, size, dump
        self.reads_request_file = local_rank == 0
        self.mailbox = host_mailbox(self.directory, host_directory)
        self.signal_name = signal_name or ""
        self._stopped = threading.Event()
        self._reader, self._writer = os.pipe()
        os.set_blocking(self._reader, False)
        os.set_blocking(self._writer, False)
        self._signal_number: Optional[int] = None
        self._previous_handler: Any = None
        self._previous_wakeup = -1
        # A request older than this rank is not for it (nor a killed run's token left in the mailbox).
        self._seen = self._posted_request()
        self._thread = threading.Thread(target=self._serve, name=f"hvdtrain-flight-rank{rank}", daemon=True)

    def start(self) -> "DumpService":
        self._alive_file().parent.mkdir(parents=True, exist_ok=True)
        write_text_atomically(self._alive_file(), json.dumps(
            {"rank": self.rank, "size": self.size, "host": socket.gethostname(), "pid": os.getpid()}))
        if self.signal_name and threading.current_thread() is threading.main_thread():
            self._take_signal()
        self._thread.start()
        return self

    def stop(self) -> None:
        """The thread ends, the signal goes back to what it was, and this rank is no longer alive."""
        self._stopped.set()
        os.write(self._writer, b"\0")  # wakes the thread
        self._thread.join(timeout=POLL_SECONDS + 1)
        if self._signal_number is not None and threading.current_thread() is threading.main_thread():
            signal.signal(self._signal_number, self._previous_handler)
            if self._previous_wakeup != -2:
                signal.set_wakeup_fd(self._previous_wakeup)
        self._leave()
        if self.reads_request_file:
            self.mailbox.unlink(missing_ok=True)
        for fd in (self._reader, self._writer):
            os.close(fd)

    def _alive_file(self) -> Path:
        return self.directory / ALIVE_DIR / f"rank-{self.rank:05d}.json"

    def _leave(self) -> None:
        """This rank's alive file goes, unless another process took its rank since (a world change)."""
        try:
            announced = json.loads(self._alive_file().read_text())
            if (announced.get("host"), announced.get("pid")) == (socket.gethostname(), os.getpid()):
                self._alive_file().unlink(missing_ok=True)
        except (OSError, ValueError, AttributeError):  # gone already, or not an alive file
            pass

    def _take_signal(self) -> None:
        number = getattr(signal, f"SIG{self.signal_name.upper().removeprefix('SIG')}")
        self._signal_number = number
        # Python's C-level handler writes the signal's number to the wakeup fd at once, from any
        # thread, even while the main thread waits in a collective; the Python handler itself runs
        # only when the main thread is back in Python, and wakes the thread only if the fd is not ours.
        previous = signal.set_wakeup_fd(self._writer, warn_on_full_buffer=False)
        if previous != -1:  # someone else's (an asyncio loop): theirs stays, the Python handler wakes us
            signal.set_wakeup_fd(previous)
            self._previous_wakeup = -2
        self._previous_handler = signal.signal(number, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._previous_wakeup == -2:
            try:
                os.write(self._writer, bytes([signum]))
            except BlockingIOError:
                pass

    def _serve(self) -> None:
        while not self._stopped.is_set():
            readable, _, _ = select.select([self._reader], [], [], POLL_SECONDS)
            if self._stopped.is_set():
                return
            if readable:
                try:
                    received = os.read(self._reader, 512)
                except BlockingIOError:
                    received = b""
                if self._signal_number is not None and self._signal_number in received:
                    self._answer(f"SIG{self.signal_name.upper().removeprefix('SIG')}", {})
                continue
            token = self._posted_request()
            if token is not None and token != self._seen:
                self._seen = token
                if self.reads_request_file:
                    self._hand_to_host(token)
                self._answer("hvdtrain debug dump", {"request": token})

    def _posted_request(self) -> Optional[str]:
        """The newest request's token: the request file's on the host's local rank 0, else the mailbox's."""
        return read_token(self.directory) if self.reads_request_file else read_posted_token(self.mailbox)

    def _hand_to_host(self, token: str) -> None:
        try:
            post_token(self.mailbox, token)
        except OSError as error:
            print(f"[hvdtrain] rank {self.rank}: the flight record request is not handed on to this host's other "
                  f"ranks ({self.mailbox}: {error})", file=sys.stderr, flush=True)

    def _answer(self, reason: str, extra: Dict[str, Any]) -> None:
        try:
            path = self._dump(reason, extra)
            print(f"[hvdtrain] rank {self.rank}: flight record written to {path} ({reason})", file=sys.stderr, flush=True)
        except Exception as error:  # a full disk must not end training
            print(f"[hvdtrain] rank {self.rank}: flight record not written ({reason}): {error}", file=sys.stderr,
                  flush=True)

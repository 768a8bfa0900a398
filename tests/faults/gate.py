"""The hung mount's gate: for each file call, whether it goes on, waits until released, or fails.

Runs in the server process (fuse_server.py), in the libfuse thread of each call; the standard
library only, so that it can be tried without FUSE.
"""
import collections
import errno
import itertools
import os
import signal
import threading
from typing import Dict, List, Optional, Tuple

from tests.faults.rules import FaultRule

POLL_SECONDS = 0.05  # how often a stopped call looks whether its caller is dying
SEEN_LIMIT = 100_000  # calls kept for calls(): a test's files are small, its calls few
SIGKILL_BIT = 1 << (signal.SIGKILL - 1)
PF_EXITING = 0x4  # the task flag of a thread that is exiting (its process was killed or exited)


def caller_is_dying(tid: int) -> bool:
    """Whether the thread that made a call has been killed or is exiting: it can never use the
    answer, and while unanswered it cannot die (it waits in D state, SIGKILL pending)."""
    try:
        with open(f"/proc/{tid}/status") as handle:
            status = dict(line.split(":", 1) for line in handle if ":" in line)
        with open(f"/proc/{tid}/stat") as handle:
            flags = int(handle.read().rsplit(")", 1)[1].split()[6])
    except (OSError, ValueError, IndexError):
        return True  # gone
    pending = int(status.get("SigPnd", "0"), 16) | int(status.get("ShdPnd", "0"), 16)
    return bool(pending & SIGKILL_BIT) or bool(flags & PF_EXITING) or status.get("State", "").strip()[:1] in "ZX"


class ProcessOfThread:
    """The process (thread group) of a calling thread: FUSE tells only the thread."""

    def __init__(self):
        self._known: Dict[int, int] = {}

    def __call__(self, tid: int) -> int:
        if tid not in self._known:
            if len(self._known) > 4096:
                self._known.clear()  # thread ids are reused in the long run; keep only recent ones
            try:
                with open(f"/proc/{tid}/status") as handle:
                    self._known[tid] = next(int(line.split()[1]) for line in handle if line.startswith("Tgid:"))
            except (OSError, StopIteration, ValueError):
                return tid
        return self._known[tid]


class Gate:
    """Decides for each call whether it goes on, waits until released, or fails; remembers the calls
    seen and those waiting, for the test to ask about."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rule: Optional[FaultRule] = None
        self._matched = 0  # calls under the rule so far (its first ``after`` go through)
        self._released = threading.Event()  # set by release(): every call waiting on it goes on
        self._waiting: Dict[int, dict] = {}
        self._ids = itertools.count()
        self._seen = collections.deque(maxlen=SEEN_LIMIT)
        self._process_of = ProcessOfThread()
        self.ready = threading.Event()  # the kernel's first request (INIT) was answered: mounted

    def set_rule(self, rule: FaultRule) -> None:
        with self._lock:
            self._rule, self._matched = rule, 0

    def release(self) -> None:
        """Lets every waiting call go on, and every later one pass, until the next rule."""
        with self._lock:
            self._rule = None
            self._released.set()
            self._released = threading.Event()

    def enter(self, op: str, paths: Tuple[str, ...], tid: int) -> None:
        """Called first by every operation, with the calling thread (0: the kernel's own request);
        returns when the call may go on, raises OSError when it is to fail."""
        call = {"op": op, "path": paths[0], "target": paths[1] if len(paths) > 1 else None,
                "pid": self._process_of(tid) if tid > 0 else 0, "tid": tid}
        with self._lock:
            self._seen.append(call)
            rule = self._rule
            if rule is None or not rule.matches(op, paths):
                return
            self._matched += 1
            if self._matched <= rule.after:
                return
            if rule.error is not None:
                raise OSError(rule.error, os.strerror(rule.error))
            released, key = self._released, next(self._ids)
            self._waiting[key] = call
        try:
            while not released.wait(POLL_SECONDS):
                if tid > 0 and caller_is_dying(tid):
                    raise OSError(errno.EINTR, "the caller is dying")
        finally:
            with self._lock:
                del self._waiting[key]

    def waiting(self) -> List[dict]:
        with self._lock:
            return list(self._waiting.values())

    def seen(self, forget: bool = False) -> List[dict]:
        with self._lock:
            calls = list(self._seen)
            if forget:
                self._seen.clear()
            return calls

"""Every rank's last collectives and step phases, kept in memory at a cost of a deque append each.

One recorder per process (``RECORDER``): Horovod's operations are process-wide, and so are the
hooks that feed it (hvdtrain.distributed.flight_hooks). An entry is a small list, appended as the
operation starts and completed in place when it ends; nothing is formatted, converted or synced
on the hot path (a shape is kept as the torch.Size it is). ``snapshot()`` turns the entries into
plain values when a dump is written.

A collective's sequence number counts the operations this process started in its process set
since the hooks went in, or since the last world change (Horovod elastic: ``new_world``); every
rank of the set runs the same operations in the same order, so the same number names the same
operation on every rank (the analysis aligns on it). A world change sets the old world's entries
aside (dumped as ``previous_world``, never aligned): a survivor's numbers restart with the new
world's first collective, as a joining worker's do, and a rolled-back step's phases are not counted
twice. A wait that raised (a rank died, Horovod shut down) ends its entry with the error, so it is
no longer in flight.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional

DEFAULT_CAPACITY = 2048  # entries of each kind: a few steps of a large model's gradient all-reduces
ERROR_CHARS = 300  # of a failed wait's error, kept in its entry (Horovod's messages run long)

# A collective entry: [seq, op, name, shape(s), dtype, process set id, start, end, error] (end None: in
# flight; error: what its wait raised, None when it completed).
SEQ, OP, NAME, SHAPE, DTYPE, PROCESS_SET, START, END, ERROR = range(9)
# A phase entry: [phase, step, start, end].
PHASE, STEP, PHASE_START, PHASE_END = range(4)


class FlightRecorder:
    """The ring buffers of one process (see the module's text); ``capacity`` 0 keeps nothing."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock  # wall time: ranks on other hosts are compared (NTP keeps them close)
        # Horovod's handle -> entry, from an operation's start to its wait (the hooks hold this dict).
        self.waiting: Dict[Any, list] = {}
        self.resize(capacity)

    def resize(self, capacity: int) -> None:
        """Keep the last ``capacity`` entries of each kind from now on (0: none; what was kept is dropped)."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"a flight recorder keeps a whole number >= 0 of entries (0: off), got {capacity!r}")
        self.capacity = capacity
        self.previous_world: Optional[Dict[str, Any]] = None
        self._start_world()

    def new_world(self) -> None:
        """Horovod elastic formed a new world: the old world's entries are set aside (the next dump
        holds them as ``previous_world``, which the analysis never aligns), and the sequence numbers
        restart with the new world's first collective. Called between worlds, when no collective runs."""
        self.previous_world = {"since": self.since, "until": self.clock(), "collectives": self.collectives,
                               "phases": self.phases}
        self._start_world()

    def _start_world(self) -> None:
        self.since = self.clock()  # when this world's record began: a dump older than it is of another world
        self.collectives: Deque[list] = deque(maxlen=self.capacity)
        self.phases: Deque[list] = deque(maxlen=self.capacity)
        self._counters: Dict[Any, Any] = {}
        self.process_sets: Dict[Any, Any] = {}  # id -> what the hooks know of its ranks (described at dumps)
        self.waiting.clear()  # cleared, not replaced: the hooks hold it; an old world's handle is never waited for

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    # --- the hot path ------------------------------------------------------------------------

    def start(self, op: str, name: Optional[str], shape: Any, dtype: Any, process_set: Any = 0) -> list:
        """A collective starts on this rank: its entry, for ``end``. Thread-safe (gradient hooks run
        on autograd's threads): the count is an itertools.count, and a deque append is atomic.

        Args:
            op: the operation (allreduce, broadcast, ...).
            name: the name it was given (None: Horovod names it).
            shape: its tensor's shape as given (a grouped operation: a list of them); not converted.
            dtype: its tensor's dtype, as given.
            process_set: the id of its process set (0: the global one).
        """
        counter = self._counters.get(process_set)
        if counter is None:
            counter = self._counters.setdefault(process_set, itertools.count())
        entry = [next(counter), op, name, shape, dtype, process_set, self.clock(), None, None]
        self.collectives.append(entry)
        return entry

    def end(self, entry: list) -> None:
        """The collective of ``entry`` completed on this rank."""
        entry[END] = self.clock()

    def fail(self, entry: list, error: BaseException) -> None:
        """The wait for ``entry``'s collective raised ``error``: it ended, without a result."""
        entry[ERROR] = f"{type(error).__name__}: {error}"[:ERROR_CHARS]
        entry[END] = self.clock()

    def begin_phase(self, phase: str, step: int) -> list:
        """The loop enters ``phase`` (data loading, forward and backward, ...) of the step after ``step``."""
        entry = [phase, step, self.clock(), None]
        self.phases.append(entry)
        return entry

    def end_phase(self, entry: list) -> None:
        entry[PHASE_END] = self.clock()

    # --- dumps -------------------------------------------------------------------------------

    def snapshot(self, describe_process_set: Callable[[Any], Optional[List[int]]] = lambda key: None
                 ) -> Dict[str, Any]:
        """The entries as plain values (JSON): collectives, phases, each process set's ranks
        (``describe_process_set(id)``; None: all ranks), when this world's record began, and the
        previous world's entries (None: no world change)."""
        collectives = list(self.collectives)  # a copy first: hooks on other threads go on appending
        previous = self.previous_world
        return {
            "capacity": self.capacity,
            "world_since": self.since,
            "collectives": plain_collectives(collectives),
            "phases": plain_phases(list(self.phases)),
            "process_sets": {str(key): describe_process_set(key) for key in {e[PROCESS_SET] for e in collectives}},
            "previous_world": None if previous is None else {
                "since": previous["since"], "until": previous["until"],
                "collectives": plain_collectives(list(previous["collectives"])),
                "phases": plain_phases(list(previous["phases"]))},
        }


def plain_collectives(entries: List[list]) -> List[Dict[str, Any]]:
    return [{"seq": e[SEQ], "op": e[OP], "name": e[NAME], "shape": plain_shape(e[SHAPE]),
             "dtype": str(e[DTYPE]).removeprefix("torch."), "process_set": e[PROCESS_SET],
             "start": e[START], "end": e[END], "error": e[ERROR]} for e in entries]


def plain_phases(entries: List[list]) -> List[Dict[str, Any]]:
    return [{"phase": e[PHASE], "step": e[STEP], "start": e[PHASE_START], "end": e[PHASE_END]} for e in entries]


def plain_shape(shape: Any) -> Any:
    """A torch.Size as a list; a grouped operation's shapes as a list of lists; None as None."""
    if shape is None:
        return None
    if shape and isinstance(shape[0], (tuple, list)):
        return [list(s) for s in shape]
    return list(shape)


RECORDER = FlightRecorder()

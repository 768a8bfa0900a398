"""The flight recorder of one Trainer: its size, the Horovod hooks, the dump service over the run
directory, and what a stall adds to the watchdog's report (where the dump went, the verdict).

The recorder itself, its dumps and their analysis are hvdtrain.common.flight; the hooks that feed
it every collective are hvdtrain.distributed.flight_hooks; the loop records its phases. A world
change (Horovod elastic) starts the record of the new world and the dump service of the rank this
process now is.
SIGUSR2 dumps, unless train.preempt_signal is USR2: then the preemption keeps it (said once), and
``hvdtrain debug dump`` and stalls still dump.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from hvdtrain.common.flight import analysis
from hvdtrain.common.flight.dumps import DUMP_SIGNAL, DumpService, flight_directory, rank_file, write_dump
from hvdtrain.common.flight.recorder import END, NAME, OP, RECORDER
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import flight_hooks
from hvdtrain.parallel.topology import Topology


def same_signal(a: str, b: str) -> bool:
    return bool(a) and bool(b) and a.upper().removeprefix("SIG") == b.upper().removeprefix("SIG")


class FlightRecording:
    """train.flight_recorder entries kept on this rank, dumped into ``open(run_dir)``'s flight/."""

    def __init__(self, config: TrainConfig, topology: Topology) -> None:
        self.topology = topology
        self.capacity = config.flight_recorder
        if RECORDER.capacity != self.capacity:  # unchanged: a second Trainer keeps the sequence going
            RECORDER.resize(self.capacity)
        if self.capacity and not flight_hooks.installed():
            missing = flight_hooks.install()
            if missing:
                topology.log.warning(f"flight recorder: this Horovod has no {', '.join(missing)}: those "
                                     f"operations are not recorded")
        self.signal = "" if same_signal(config.preempt_signal, DUMP_SIGNAL) else DUMP_SIGNAL
        if self.capacity and not self.signal and topology.is_root:
            topology.log.info(f"SIG{DUMP_SIGNAL} is train.preempt_signal: it asks for a preemption, not a flight "
                              f"record; `hvdtrain debug dump RUN_DIR` and stalls still dump")
        self.directory: Optional[Path] = None
        self._service: Optional[DumpService] = None
        topology.follow(self._follow_world)

    def open(self, run_dir: Optional[Path]) -> None:
        """Dumps go to ``run_dir``/flight from now on (None: no run directory, no dumps); the
        service answers SIGUSR2 and ``hvdtrain debug dump``. Again with the same directory: nothing."""
        if not self.capacity or run_dir is None or self.directory == flight_directory(run_dir):
            return
        self.close()
        self.directory = flight_directory(run_dir)
        world = self.topology.world
        self._service = DumpService(self.directory, world.rank, world.size, self.signal, self.dump,
                                    local_rank=world.local_rank).start()

    def _follow_world(self, topology: Topology) -> None:
        """Horovod elastic formed a new world: its sequence numbers start again (every rank of it, a
        joining one too, counts from its first collective), and the service answers as this process's
        new rank (its alive file, and which rank of this host looks at the request file)."""
        RECORDER.new_world()
        if self.directory is not None:
            run_dir = self.directory.parent
            self.close()
            self.open(run_dir)

    def close(self) -> None:
        if self._service is not None:
            self._service.stop()
            self._service = None
        self.directory = None

    def dump(self, reason: str, extra: Optional[Dict[str, Any]] = None) -> Path:
        """This rank's record and stacks into the run directory's flight/; its path."""
        world = self.topology.world
        return write_dump(self.directory, world.rank, world.size, reason, RECORDER,
                          flight_hooks.describe_process_set, extra)

    # --- on a stall (the watchdog's thread) ------------------------------------------------------

    def in_flight(self) -> List[str]:
        """The Horovod operations this rank started and has not seen end, oldest first ("allreduce
        'loss'"): what it waits in when the strategy's own reductions are not pending."""
        return [f"{entry[OP]} '{entry[NAME]}'" if entry[NAME] else entry[OP]
                for entry in list(RECORDER.collectives) if entry[END] is None]

    def on_stall(self) -> str:
        """This rank's dump, written (the watchdog's side thread: the run directory may hang); where
        it went, in words for the stall report ('': no flight recorder)."""
        if not self.capacity:
            return ""
        if self.directory is None:
            return "No flight record: set train.run_dir to have one written on a stall."
        self._stalled_at = time.time()
        try:
            return f"Flight record: {self.dump('stall')}."
        except Exception as error:  # the report goes out all the same
            return f"Flight record not written: {error}."

    def verdict(self, within: float) -> str:
        """Rank 0: once every rank's stall dump is in (at most ``within`` seconds), the analysis'
        verdict, printed; elsewhere, or without dumps, ''."""
        if self.directory is None or not self.capacity or not self.topology.is_root:
            return ""
        size, started = self.topology.world.size, getattr(self, "_stalled_at", time.time())
        deadline = time.monotonic() + within
        # Every rank's watchdog fires within one interval of this one: its dump is at most that old.
        fresh = started - within
        while time.monotonic() < deadline and not all(_written_since(rank_file(self.directory, r), fresh)
                                                      for r in range(size)):
            time.sleep(0.1)
        try:
            dumps = [d for d in analysis.load_dumps(self.directory) if d["written"] >= fresh]
            line = analysis.analyze(dumps).verdict()
        except Exception as error:  # a verdict is a help; the stall report is out already
            line = f"no verdict ({error})"
        print(f"[hvdtrain] flight records: {line}. Details: hvdtrain debug analyze {self.directory.parent}",
              file=sys.stderr, flush=True)
        return line


def _written_since(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except OSError:
        return False

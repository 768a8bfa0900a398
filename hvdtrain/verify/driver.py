"""Run the layout checks for families x layouts: one launch per world size, the families in sequence
inside it (a launch costs seconds; a case about one), each case's outcome read as it ends.

A family that crashes its launch, or runs past its time limit (a hang: a refusal raised on some
ranks only, a collective the others never join), ends as ``error`` for each case it had left; a
new launch goes on with the families after it. Nothing one family does stops the others.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from hvdtrain.common.errors import HvdtrainError
from hvdtrain.launch.commands import job_argv
from hvdtrain.launch.sessions import kill_session
from hvdtrain.verify.layouts import Layout
from hvdtrain.verify.outcome import Outcome

WORKER = "hvdtrain.verify.worker"
STARTED = "started"  # hvdtrain.verify.worker's event when a family starts
FAMILY_TIMEOUT = 300.0  # seconds for one family's cases in one launch
START_TIMEOUT = 180.0  # seconds for a launch to start its first family (imports, Horovod's start)


class LaunchFailed(HvdtrainError, RuntimeError):
    """A launch that never reached its first family (Horovod did not start, the worker cannot import)."""


def run(families: Sequence[str], layouts: Sequence[Layout], optimizers: Sequence[str], steps: int,
        family_timeout: float = FAMILY_TIMEOUT, launcher: str = "horovodrun", log_dir: Optional[Path] = None,
        extra_args: Sequence[str] = (), on_outcome: Optional[Callable[[Outcome], None]] = None) -> List[Outcome]:
    """Every (family, layout, optimizer)'s outcome, world size by world size.

    Args:
        families: the Hugging Face families.
        layouts: the layouts to try each under.
        optimizers: the optimizers' names.
        steps: optimizer steps per case.
        family_timeout: seconds a family may take before its launch is stopped.
        launcher: horovodrun or mpirun.
        log_dir: where each launch's log is written (None: a temporary directory).
        extra_args: more arguments for the worker.
        on_outcome: called with each outcome as it arrives (the sweep writes them out as it goes).
    """
    outcomes: List[Outcome] = []
    for ranks, group in _by_ranks(layouts).items():
        remaining = list(families)
        while remaining:
            done, remaining = _launch(remaining, group, ranks, optimizers, steps, family_timeout, launcher,
                                      log_dir, extra_args, on_outcome)
            outcomes += done
    return outcomes


def _by_ranks(layouts: Iterable[Layout]) -> Dict[int, List[Layout]]:
    groups: Dict[int, List[Layout]] = OrderedDict()
    for layout in layouts:
        groups.setdefault(layout.ranks, []).append(layout)
    return groups


def _launch(families: List[str], layouts: List[Layout], ranks: int, optimizers: Sequence[str], steps: int,
            family_timeout: float, launcher: str, log_dir: Optional[Path], extra_args: Sequence[str],
            on_outcome: Optional[Callable[[Outcome], None]]):
    """One launch over ``families``: (the outcomes it gave, the families it did not reach)."""
    with tempfile.TemporaryDirectory(prefix="hvdtrain-verify-") as tmp:
        out = Path(tmp) / "outcomes.jsonl"
        out.touch()
        log_path = (log_dir or Path(tmp)) / f"launch-{ranks}-{families[0]}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", WORKER, "--out", str(out), "--families", ",".join(families),
                   "--layouts", ",".join(layout.name for layout in layouts), "--optimizers", ",".join(optimizers),
                   "--steps", str(steps), *extra_args]
        environ = dict(os.environ, TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore")
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            environ.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        with open(log_path, "w") as log:
            # Own session: a time limit kills every rank, not only the launcher.
            process = subprocess.Popen(job_argv(command, ranks, launcher, environ=environ), env=environ,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            outcomes, current, stopped = _follow(process, out, family_timeout, on_outcome)
        if current is None:
            if process.returncode == 0:
                return outcomes, []
            # No family started: nothing to blame on one, and every new launch would end alike.
            raise LaunchFailed(f"the launch of {ranks} ranks ended before its first family "
                               f"({stopped or f'exit {process.returncode}'}); its last output: {_tail(log_path)}")
        why = stopped or f"the launch exited {process.returncode} during it; its last output: {_tail(log_path)}"
        seen = {(o.layout, o.optimizer) for o in outcomes if o.family == current}
        for layout in layouts:
            for optimizer in optimizers:
                if (layout.name, optimizer) not in seen:
                    lost = Outcome(current, layout.name, optimizer, "error", message=why)
                    outcomes.append(lost)
                    if on_outcome:
                        on_outcome(lost)
        return outcomes, families[families.index(current) + 1:]


def _follow(process: subprocess.Popen, out: Path, family_timeout: float,
            on_outcome: Optional[Callable[[Outcome], None]]):
    """Read the worker's lines until it exits or a family runs past its limit (then kill the launch).
    Returns (outcomes, the family in progress when it ended or None, why it was stopped or None)."""
    outcomes: List[Outcome] = []
    current: Optional[str] = None
    since = time.monotonic()
    position = 0
    while True:
        exited = process.poll() is not None
        with open(out) as file:
            file.seek(position)
            chunk = file.read()
        complete = chunk[:chunk.rfind("\n") + 1]  # a line is read once it is whole
        position += len(complete)
        for line in complete.splitlines():
            record = json.loads(line)
            if record.get("event") == STARTED:
                current, since = record["family"], time.monotonic()
                continue
            outcome = Outcome.from_json(line)
            outcomes.append(outcome)
            if on_outcome:
                on_outcome(outcome)
        if exited:
            # Each family's last line is its last case: one that ended whole is not in progress.
            finished = process.returncode == 0
            return outcomes, (None if finished else current), None
        limit = family_timeout if current is not None else START_TIMEOUT
        if time.monotonic() - since > limit:
            kill_session(process.pid)
            process.wait()
            what = f"{current} did not finish in {family_timeout:.0f} s (a hang, or too slow)" if current \
                else f"the launch did not start its first family in {START_TIMEOUT:.0f} s"
            return outcomes, current, what
        time.sleep(0.5)


def _tail(path: Path, lines: int = 3) -> str:
    text = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(text[-lines:])[-600:]

"""What the Trainer does about failures: a preemption signal, a rank that stalls.

Preemption: every rank votes every few steps; when they agree, they checkpoint at the same step
boundary, rank 0 requeues the SLURM job, and fit() returns. Stalls: every rank runs a watchdog that
ends the job, naming where it is stuck, when no step finishes within the timeout, or a checkpoint
file's bytes stop moving (train.checkpoint_timeout). (Horovod elastic,
the third kind, is hvdtrain.fault_tolerance.elastic.)
"""
from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from typing import Callable, ContextManager, Iterator, List, Optional, Tuple

from hvdtrain.config.train import TrainConfig
from hvdtrain.fault_tolerance.flight import FlightRecording
from hvdtrain.fault_tolerance.preemption import PreemptionFlag, requeue, requeue_command
from hvdtrain.fault_tolerance.watchdog import StallWatchdog
from hvdtrain.parallel.topology import Topology


class FaultHandling:
    """The preemption vote and the stall watchdog of one Trainer."""

    def __init__(self, config: TrainConfig, topology: Topology) -> None:
        self.config, self.topology = config, topology
        self.preemption = PreemptionFlag(config.preempt_signal, on_term=config.preempt_on_term)
        self.watchdog: Optional[StallWatchdog] = None
        self.flight = FlightRecording(config, topology)
        topology.follow(self._follow)

    def _follow(self, topology: Topology) -> None:
        if self.watchdog is not None:
            self.watchdog.rank = topology.world.rank

    def start_watchdog(self, pending: Optional[Callable[[], List[str]]], phase: str = "training") -> None:
        if self.config.stall_timeout or self.config.checkpoint_timeout:
            world = self.topology.world
            self.watchdog = StallWatchdog(self.config.stall_timeout, world.rank, world.hostname, pending,
                                          phase=phase, io_timeout=self.config.checkpoint_timeout)
            self.watchdog.flight = self.flight
            self.watchdog.start()

    def stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    @contextmanager
    def guarding_setup(self) -> Iterator[None]:
        """The watchdog over the Trainer's set-up: a rank stuck in one of its collectives ends the job
        too. Stopped after, so that the caller's own code between set-up and fit() is never timed."""
        self.start_watchdog(None, phase="set-up")
        try:
            yield
        finally:
            self.stop_watchdog()

    def checkpoint_io(self) -> ContextManager[None]:
        """Writing or reading a large checkpoint is slow, not stuck: the step clock is paused while every
        rank saves or resumes; each file in flight is watched by train.checkpoint_timeout instead."""
        return self.watchdog.paused() if self.watchdog is not None else nullcontext()

    def beat(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def votes(self, step: int, stop_asked: bool) -> Tuple[bool, bool]:
        """Every preempt_check_every steps, all ranks vote (one collective) on a preemption signal and
        on a callback's stop: (preempt, stop), True on every rank when one rank asked; else no vote."""
        if step % self.config.preempt_check_every:
            return False, False
        return self.preemption.agreed(stop_asked)

    def requeue_after_preemption(self, step: int) -> None:
        """Rank 0 requeues the SLURM job (the checkpoint is written already); elsewhere, says how to resume."""
        if not self.topology.is_root:
            return
        log = self.topology.log
        command = requeue_command(os.environ)
        if command is None:
            log.info(f"preempted after step {step}: not a SLURM job, start it again to resume")
            return
        log.info(f"preempted after step {step}: requeueing with `{' '.join(command)}`")
        failure = requeue(command)  # SLURM may end this process during the call
        if failure:
            log.warning(failure)

"""What the Trainer does about failures: a preemption signal, a rank that stalls.

Preemption: every rank votes every few steps; when they agree, they checkpoint at the same step
boundary, rank 0 requeues the SLURM job, and fit() returns. Stalls: every rank runs a watchdog
that ends the job, naming where it is stuck, when no step finishes within the timeout.
(Horovod elastic, the third kind of failure handling, lives in hvdtrain.fault_tolerance.elastic.)
"""
from __future__ import annotations

import logging
import os
from typing import Callable, List, Optional

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed.startup import World
from hvdtrain.fault_tolerance.preemption import PreemptionFlag, requeue, requeue_command
from hvdtrain.fault_tolerance.watchdog import StallWatchdog


class FaultHandling:
    """The preemption vote and the stall watchdog of one Trainer."""

    def __init__(self, config: TrainConfig, world: World, log: logging.Logger) -> None:
        self.config, self.world, self.log = config, world, log
        self.preemption = PreemptionFlag(config.preempt_signal)
        self.watchdog: Optional[StallWatchdog] = None

    def follow(self, world: World, log: logging.Logger) -> None:
        """Elastic reset: this process may hold another rank now."""
        self.world, self.log = world, log
        if self.watchdog is not None:
            self.watchdog.rank = world.rank

    def start_watchdog(self, pending: Callable[[], List[str]]) -> None:
        if self.config.stall_timeout:
            self.watchdog = StallWatchdog(self.config.stall_timeout, self.world.rank, self.world.hostname,
                                          pending).start()

    def stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def beat(self, step: int) -> None:
        if self.watchdog is not None:
            self.watchdog.beat(step)

    def preemption_agreed(self, step: int) -> bool:
        """Every preempt_check_every steps, all ranks vote (a collective); True when one was signalled."""
        return step % self.config.preempt_check_every == 0 and self.preemption.agreed()

    def requeue_after_preemption(self, step: int) -> None:
        """Rank 0 requeues the SLURM job (the checkpoint is written already); elsewhere, says how to resume."""
        if not self.world.is_root:
            return
        command = requeue_command(os.environ)
        if command is None:
            self.log.info(f"preempted after step {step}: not a SLURM job, start it again to resume")
            return
        self.log.info(f"preempted after step {step}: requeueing with `{' '.join(command)}`")
        failure = requeue(command)  # SLURM may end this process during the call
        if failure:
            self.log.warning(failure)

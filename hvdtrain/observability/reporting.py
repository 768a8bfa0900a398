"""What a run tells its user: the start lines, rank 0's progress, the run directory's records, what
each rank holds after the first step, and a Horovod timeline window. Rank 0 speaks; every rank
takes part in the collectives (the hosts gathered for the start lines, the memory report)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

import yaml

from hvdtrain.common.startup_clock import CLOCK as STARTUP_CLOCK
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.distributed import startup
from hvdtrain.observability.efficiency import Efficiency, describe
from hvdtrain.observability.memory import MemoryReport
from hvdtrain.observability.progress import Progress, resolve_mode
from hvdtrain.observability.metric_sinks import open_sinks
from hvdtrain.observability.run_directory import RunDirectory, default_run_name
from hvdtrain.observability.timeline import TimelineWindow
from hvdtrain.parallel.mesh import layout_lines
from hvdtrain.parallel.sequence.groups import group_ranks
from hvdtrain.parallel.topology import Topology
from hvdtrain.strategies.base import Strategy


def epoch_line(record: Mapping[str, Any], epochs: int) -> str:
    """The line rank 0 prints at the end of an epoch (or where max_steps ended it): the epoch by its
    index from 0, as epochs() yields it, then the run's epochs done out of train.epochs.

    Horovod elastic can roll back to a commit at an epoch's last step: the epoch then ends with no
    step of its own, and is recorded without a train loss."""
    done = record["epochs_done"]
    ended = "done" if done >= record["epoch"] + 1 else "stopped"
    line = f"epoch {record['epoch']} {ended} ({done:.3g}/{epochs} epochs) step {record['step']}"
    if "train_loss" in record:
        line += f" train_loss {record['train_loss']:.4f}"
    if "val_accuracy" in record:
        line += f" val_loss {record['val_loss']:.4f} val_accuracy {record['val_accuracy']:.4f}"
    figures = describe(record)
    return line + f" {record['samples_per_sec']:.0f} samples/s" + (f", {figures}" if figures else "")


class Reporter:
    """The Trainer's reporting part.

    Args:
        config: the run's settings.
        topology: the world, and the mesh over it when a replica spans several ranks.
        job_config: the job's settings, every section: written to the run directory and logged.
        strategy: the strategy, for the start line and the memory report.
        elastic: Horovod elastic runs the job (set-up then runs no collective).
        efficiency: the model FLOPs and the peak, for tokens/s, TFLOPs/s and MFU (None: not reported).
    """

    def __init__(self, config: TrainConfig, topology: Topology, job_config: Mapping[str, Any],
                 strategy: Strategy, elastic: bool, efficiency: Optional[Efficiency] = None) -> None:
        self.config, self.topology, self.job_config, self.elastic = config, topology, job_config, elastic
        self.efficiency = efficiency
        self.started = time.time()
        self.run_dir: Optional[RunDirectory] = None
        self.run_name = self._agreed_name() if config.run_dir else None
        if self.run_name is not None:
            self._open(self.run_name)
        self.progress = Progress("off", 0, 0, topology.log)
        self.memory = MemoryReport(strategy, topology, gather=not elastic)
        self.timeline: Optional[TimelineWindow] = None
        topology.follow(self._follow)

    # --- the run directory -------------------------------------------------------------------

    def _agreed_name(self) -> Optional[str]:
        """This run's directory name, the same on every rank: train.run_name, SLURM's job, or rank 0's
        start time. Elastic set-up runs no collective: there only rank 0 knows the start time, and
        the others learn it at the first elastic sync (agree_run_directory)."""
        config = self.config
        name = config.run_name or default_run_name(os.environ)
        if config.run_name:
            return name
        if self.elastic:
            return name if self.topology.is_root or "SLURM_JOB_ID" in os.environ else None
        return collectives.broadcast_object(name, root_rank=0, name="trainer.run_name")

    def _open(self, name: str) -> None:
        path = Path(self.config.run_dir) / name
        path.mkdir(parents=True, exist_ok=True)
        log = self.topology.log
        config = self.config
        self.run_dir = RunDirectory(path, self.topology.world, log, config.tensorboard, lambda directory: open_sinks(
            directory, config.tensorboard, config.loggers, name, self.job_config, config.mlflow_tracking_uri,
            config.mlflow_experiment, config.wandb_project), started=self.started)
        self.run_dir.write_config(self.job_config)
        log.info(f"run directory {path} (config.yaml, metrics.jsonl, tensorboard/, logs/rank-*.log)")

    def agree_run_directory(self) -> None:
        """Under Horovod elastic (a collective, at every sync): every rank writes into rank 0's run
        directory, so that whichever rank is 0 after a lost host keeps the metrics going."""
        if not self.config.run_dir:
            return
        name = collectives.broadcast_object(self.run_name, root_rank=0, name="trainer.run_name")
        if self.run_dir is None and name is not None:
            self.run_name = name
            self._open(name)

    def _follow(self, topology: Topology) -> None:
        if self.run_dir is not None:
            self.run_dir.follow(topology.world, topology.log)

    @property
    def path(self) -> Optional[Path]:
        return self.run_dir.path if self.run_dir is not None else None

    def record(self, kind: str, values: Mapping[str, Any]) -> None:
        if self.run_dir is not None:
            self.run_dir.record(kind, values)

    # --- start lines -------------------------------------------------------------------------

    def announce(self, setup_line: str) -> None:
        """Who runs where (the hosts: a collective, so every rank calls it), the set-up, the settings."""
        world, log, mesh = self.topology.world, self.topology.log, self.topology.mesh
        log.info(f"{world.size} workers ({world.cross_size} hosts x {world.local_size}) started by {world.launcher}, "
                 f"{world.controller.upper()} controller, {world.threads} threads/rank, device {world.device}"
                 + (f", {world.cpu_allocator}" if world.cpu_allocator else ""))
        if not self.elastic:  # no collective in elastic set-up
            hosts = collectives.allgather_object(world.hostname, name="trainer.hosts")
            ranks_by_host: Dict[str, List[int]] = {}
            for rank, host in enumerate(hosts):
                ranks_by_host.setdefault(host, []).append(rank)
            log.info("ranks per host: " + "; ".join(
                f"{host}: {','.join(map(str, ranks))}" for host, ranks in ranks_by_host.items()))
            if mesh is not None:
                shape = mesh.shape
                log.info(f"mesh: data {shape.data} x pipeline {shape.pipeline} x tensor {shape.tensor} "
                         f"(tensor innermost, then stages, then data replicas)")
                for line in layout_lines(shape, hosts):
                    log.info(line)
            sequence = self.topology.sequence
            if sequence is not None:  # which ranks share a batch, each its part of every sequence
                groups = group_ranks(world.size, sequence.size, sequence.tensor)
                log.info(f"sequence groups of {sequence.size} ranks (each its 1/{sequence.size} of every sequence, "
                         f"one data worker's batch per group): " + "; ".join(",".join(map(str, g)) for g in groups))
        log.info(setup_line)
        if world.hierarchical_allreduce:
            log.info(startup.hierarchical_effect(True, collectives.nccl_built(), world.device.type, world.cross_size))
        log.info("settings:\n" + yaml.safe_dump(dict(self.job_config), sort_keys=False).rstrip())

    # --- during training ---------------------------------------------------------------------

    def open_timeline(self, step: int) -> None:
        """The timeline window of this start: after 5 warm-up steps from ``step``."""
        self.timeline = TimelineWindow(self.config.timeline_steps, step, self.run_dir, self.topology.log)

    def start(self, total_steps: int, step: int) -> None:
        """fit() begins: rank 0's progress display, from ``step`` of ``total_steps``."""
        mode = resolve_mode(self.config.progress, self.topology.is_root)
        self.progress = Progress(mode, total_steps, step, self.topology.log)
        STARTUP_CLOCK.mark("set-up")

    def first_batch(self, batch: Any, samples: int) -> None:
        """Every rank, at each start's first batch: the model FLOPs counted, once (no collective)."""
        if self.efficiency is not None and not self.efficiency.counted:
            self.progress.message(self.efficiency.count(batch, samples))

    def efficiency_figures(self, samples_per_sec: float) -> Dict[str, float]:
        """tokens_per_sec (token models), tflops_per_rank and mfu at a global ``samples_per_sec``."""
        if self.efficiency is None:
            return {}
        return self.efficiency.figures(samples_per_sec, self.topology.world.size)

    def after_step(self, step: int) -> None:
        self.progress.advance()
        if self.timeline is not None:
            self.timeline.after_step(step)

    def after_first_step(self, step: int) -> None:
        """What each rank holds, once, before the first step's gradients are cleared (a collective);
        and where start-up went. The loop calls it after every step: the later calls return at once."""
        if self.memory.per_rank is not None:
            return
        self.memory.after_first_step(self.run_dir, step)
        STARTUP_CLOCK.mark("first step")
        startup = STARTUP_CLOCK.take_report()
        if startup is not None:  # rank 0's clock: the first step ends in the same collective on every rank
            self.topology.log.info(STARTUP_CLOCK.line())
            self.record("startup", {"step": step, **startup})

    def window(self, epoch: int, epochs_done: float, step: int, means: Dict[str, float], lr: float,
               samples_per_sec: float, comm_fraction: float, extra: Mapping[str, Any]) -> None:
        """Every log_every steps: the progress display and a step record (rank 0's clock measures the
        job: every step ends in the same collective on every rank).

        Args:
            epoch: the epoch's index, from 0 (as epochs() yields it).
            epochs_done: the run's progress in epochs (fractional: samples done in this one).
            step: optimizer steps done.
            means: the window's mean loss and metrics.
            lr: the current learning rate.
            samples_per_sec: global samples per second over the window.
            comm_fraction: the share of the window spent waiting for gradients.
            extra: more fields of the step record.
        """
        figures = self.efficiency_figures(samples_per_sec)
        self.progress.report(epoch, step, means["loss"], lr, samples_per_sec, comm_fraction, figures)
        self.record("step", {"step": step, "epoch": epoch, "epochs_done": epochs_done, **means, "lr": lr, "samples_per_sec": samples_per_sec,
                             **figures, "comm_fraction": comm_fraction, **extra})

    def epoch(self, record: Mapping[str, Any]) -> None:
        self.record("epoch", record)
        self.progress.message(epoch_line(record, self.config.epochs))

    def evaluation(self, record: Mapping[str, Any]) -> None:
        """An evaluation between steps (train.eval_every): an ``evaluation`` record and a line."""
        self.record("evaluation", record)
        metrics = " ".join(f"{key} {value:.4f}" for key, value in record.items()
                           if key.startswith("val_") and key != "val_samples")
        self.progress.message(f"evaluation at step {record['step']}: {metrics}")

    def finish(self, step: int) -> None:
        """fit() ends (normally or not)."""
        self.progress.close()
        if self.timeline is not None:
            self.timeline.close(step)

    def close(self) -> None:
        """Close the run directory's files (metrics, TensorBoard, this rank's log)."""
        if self.run_dir is not None:
            self.run_dir.close()
            self.run_dir = None

"""What a run tells its user: the start lines, the run directory, the step and epoch records,
and a Horovod timeline of a few steps. Rank 0 speaks; every rank takes part in the collectives."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Tuple

import yaml

from hvdtrain.distributed import startup as dist
from hvdtrain.config.train import TrainConfig
from hvdtrain.parallel.mesh import Mesh, layout_lines
from hvdtrain.common.units import format_bytes  # noqa: F401  (re-exported: hvdtrain.observability.reporting.format_bytes)
from hvdtrain.observability.run_directory import TIMELINE_FILE, RunDirectory, default_run_name


def open_run_dir(config: TrainConfig, world: dist.World, log: logging.Logger,
                 job_config: Mapping[str, Any], elastic: bool) -> Optional[RunDirectory]:
    """This run's directory: the same name on every rank (rank 0's start time, or SLURM's job)."""
    if not config.run_dir:
        return None
    name = config.run_name or default_run_name(os.environ)
    if not config.run_name and not elastic:  # start times differ by rank: use rank 0's
        name = dist.broadcast_object(name, root_rank=0, name="trainer.run_name")
    if elastic and not world.is_root and not config.run_name and "SLURM_JOB_ID" not in os.environ:
        # No collective in elastic set-up, so no shared name: rank 0 alone keeps files.
        log.warning("elastic run without train.run_name: only rank 0 writes the run directory")
        return None
    path = Path(config.run_dir) / name
    path.mkdir(parents=True, exist_ok=True)
    run = RunDirectory(path, world, log, config.tensorboard)
    run.write_config(job_config)
    log.info(f"run directory {path} (config.yaml, metrics.jsonl, tensorboard/, logs/rank-*.log)")
    return run


def announce(world: dist.World, log: logging.Logger, elastic: bool, mesh: Optional[Mesh] = None) -> None:
    """Who runs where: the world, and (a collective, so every rank calls it) the ranks per host."""
    log.info(
        f"{world.size} workers ({world.cross_size} hosts x {world.local_size}) started by {world.launcher}, "
        f"{world.controller.upper()} controller, {world.threads} threads/rank, device {world.device}"
    )
    if elastic:  # no collective in elastic set-up
        return
    hosts = dist.allgather_object(world.hostname, name="trainer.hosts")
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


def announce_settings(log: logging.Logger, job_config: Mapping[str, Any]) -> None:
    log.info("settings:\n" + yaml.safe_dump(dict(job_config), sort_keys=False).rstrip())


def epoch_line(record: Mapping[str, Any], epochs: int) -> str:
    """The line rank 0 prints at the end of an epoch (or where max_steps ended it).

    An epoch can end without a step of its own: Horovod elastic rolls back to a commit made at the
    epoch's last step, and the epoch's end is then recorded without a train loss (its steps' losses
    went with the rollback)."""
    line = f"epoch {record['epoch']:g}/{epochs} step {record['step']}"
    if "train_loss" in record:
        line += f" train_loss {record['train_loss']:.4f}"
    if "val_accuracy" in record:
        line += f" val_loss {record['val_loss']:.4f} val_accuracy {record['val_accuracy']:.4f}"
    return line + f" {record['samples_per_sec']:.0f} samples/s"


class TimelineWindow:
    """Horovod's timeline for ``steps`` steps, after 5 warm-up steps of this start.

    Every rank starts and stops it at the same step (both are collectives in Horovod).
    """

    def __init__(self, steps: int, first_step: int, run_dir: Optional[RunDirectory], log: logging.Logger) -> None:
        self.log = log
        self.window: Optional[Tuple[int, int]] = None
        self._run_dir = run_dir
        self._file = ""
        if not steps:
            return
        if not dist.timeline_armed():
            log.warning(f"train.timeline_steps={steps} ignored: start Horovod with "
                        f"hvdtrain.init(..., timeline=True) to record a timeline")
            return
        first = first_step + 5
        self.window = (first, first + steps)

    def _path(self) -> str:
        if self._run_dir is not None:
            return str(self._run_dir.path / TIMELINE_FILE)
        return os.path.abspath(f"horovod-timeline-{time.strftime('%Y%m%d-%H%M%S')}.json")

    def after_step(self, step: int) -> None:
        """Start or stop the timeline at the window's edges."""
        if self.window is None:
            return
        first, last = self.window
        if step == first:
            self._file = self._path()
            dist.start_timeline(self._file)
        elif step == last:
            dist.stop_timeline()
            self.window = None
            self.log.info(f"Horovod timeline of steps {first + 1}-{last} written to {self._file}: "
                          f"open it in https://ui.perfetto.dev or chrome://tracing (Load)")

    def close(self, step: int) -> None:
        """Training ended inside the window: close the file."""
        if self.window is not None and step >= self.window[0]:
            dist.stop_timeline()
            self.window = None

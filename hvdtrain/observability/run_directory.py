"""One directory per run: the resolved config, metrics as JSON lines, TensorBoard events, per-rank logs.

    runs/<run name>/
      config.yaml           the resolved settings (rank 0)
      metrics.jsonl         a "step" record every log_every steps, an "epoch" record per epoch (rank 0)
      tensorboard/          event files for `tensorboard --logdir runs` (rank 0)
      metrics-<kind>.csv    train.loggers=[csv]; mlflow_run_id: train.loggers=[mlflow] (metric_sinks.py)
      logs/rank-<r>.log     everything rank r logged, INFO and up, with time, rank and host
      horovod-timeline.json when train.timeline_steps > 0 (rank 0)
      model.safetensors     the trained model, written by Trainer.run() at the end (rank 0)

A run started again with the same name (a SLURM requeue, or an explicit train.run_name)
appends to the same files; ``hvdtrain plot`` lets the later record of a step win.
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import yaml

from hvdtrain.common.atomic import write_text_atomically
from hvdtrain.distributed.logs import add_file
from hvdtrain.observability.metric_sinks import JSONLinesSink, TensorBoardSink

if TYPE_CHECKING:  # `hvdtrain plot` reads these names on machines without torch or Horovod
    from hvdtrain.distributed.world import World

CONFIG_FILE = "config.yaml"
TIMELINE_FILE = "horovod-timeline.json"


def default_run_name(environ: Mapping[str, str], now: Optional[float] = None) -> str:
    """slurm-<job id> inside a SLURM job (stable across requeues), else the start time."""
    job = environ.get("SLURM_JOB_ID")
    if job:
        return f"slurm-{job}"
    return time.strftime("%Y%m%d-%H%M%S", time.localtime(now))


class RunDirectory:
    """Files of one run. Rank 0 writes the shared files; every rank writes its own log."""

    def __init__(self, path: Path, world: "World", logger: logging.Logger, tensorboard: bool,
                 open_sinks: Optional[Callable[[Path], list]] = None, started: Optional[float] = None) -> None:
        """The run's files under ``path``, set up for this rank (``follow``).

        Args:
            path: the run directory.
            world: this rank's World.
            logger: the logger whose lines also go to this rank's log file.
            tensorboard: write TensorBoard events (when ``open_sinks`` is not given).
            open_sinks: ``open_sinks(path)``: where records go besides metrics.jsonl
                (hvdtrain.observability.metric_sinks); None: TensorBoard when ``tensorboard``.
            started: the run's start (time.time()), which each record's elapsed seconds count from (None: now).
        """
        self.path = path
        self.started = time.time() if started is None else started
        self._open_sinks = open_sinks or (lambda path: [TensorBoardSink(path)] if tensorboard else [])
        self._sinks: list = []  # open on rank 0 only: metrics.jsonl's first
        self._logger: Optional[logging.Logger] = None
        self._log_handler: Optional[logging.Handler] = None
        self.follow(world, logger)

    def follow(self, world: "World", logger: logging.Logger) -> None:
        """This process's rank is ``world.rank`` now (Horovod elastic re-formed the world): its log
        goes to that rank's file, and if it became rank 0 it takes over the shared files (appended)."""
        self.world = world
        if self._log_handler is not None:
            self._logger.removeHandler(self._log_handler)
            self._log_handler.close()
        self._logger = logger
        self._log_handler = add_file(logger, self.path / "logs" / f"rank-{world.rank}.log", world)
        if world.is_root and not self._sinks:
            self._sinks = [JSONLinesSink(self.path, self.started), *self._open_sinks(self.path)]
        elif not world.is_root:
            self._close_shared_files()

    def write_config(self, config: Mapping[str, Any]) -> None:
        if not self.world.is_root:
            return
        write_text_atomically(self.path / CONFIG_FILE, yaml.safe_dump(dict(config), sort_keys=False))

    def record(self, kind: str, values: Mapping[str, Any]) -> None:
        """One metrics record, to every sink (rank 0): metrics.jsonl, TensorBoard, ..."""
        for sink in self._sinks:
            sink.write(kind, values)

    def close(self) -> None:
        if self._log_handler is not None:
            self._logger.removeHandler(self._log_handler)
            self._log_handler.close()
            self._log_handler = None
        self._close_shared_files()

    def _close_shared_files(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []

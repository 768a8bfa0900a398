"""Where rank 0's metric records go: metrics.jsonl always, and train.tensorboard and train.loggers.
One small interface, ``write(kind, values)`` and ``close()``, called only where the run directory's
shared files are open (rank 0; under Horovod elastic, whichever rank is 0 now).

    jsonl        metrics.jsonl, one JSON line per record: its kind, the time, the seconds since the
                 run started, and the values (what ``hvdtrain plot`` reads)
    tensorboard  event files in tensorboard/ (``kind/key`` scalars)
    csv          metrics-<kind>.csv, one row per record, a column per key (a new key adds a column)
    mlflow       an MLflow run in train.mlflow_tracking_uri (default: sqlite in run_dir/mlflow.db),
                 experiment train.mlflow_experiment; the settings as its parameters, the records as
                 ``kind/key`` metrics at their step. The run's id is kept in the run directory, so a
                 requeued job (or a new rank 0) continues the same MLflow run.
    wandb        a W&B run in offline mode (nothing leaves the machine; ``wandb sync <run_dir>/wandb/
                 offline-run-*`` uploads it later), project train.wandb_project, under run_dir/wandb/;
                 the settings as its config, the records as ``kind/key`` at their step. The run's id is
                 kept in the run directory: a requeued job logs to the same W&B run id.
"""
from __future__ import annotations

import csv
import json
import math
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from hvdtrain.common.nested import flatten

METRICS_FILE = "metrics.jsonl"
MLFLOW_RUN_ID_FILE = "mlflow_run_id"
WANDB_RUN_ID_FILE = "wandb_run_id"


def numbers(values: Mapping[str, Any], skip: tuple = ("step",)) -> Dict[str, float]:
    """The finite numbers of a record (what a metric store takes), ``skip`` left out."""
    return {key: float(value) for key, value in values.items()
            if key not in skip and isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value)}


class JSONLinesSink:
    """metrics.jsonl, appended to (a run started again under the same name goes on in it)."""

    def __init__(self, path: Path, started: float) -> None:
        self.started = started  # the run's start: each record's "elapsed" counts from it
        self.file = open(path / METRICS_FILE, "a", encoding="utf-8")

    def write(self, kind: str, values: Mapping[str, Any]) -> None:
        now = time.time()
        entry = {"kind": kind, "time": round(now, 3), "elapsed": round(now - self.started, 3), **values}
        # One line per write, flushed: a run killed now leaves at most one partial line.
        self.file.write(json.dumps({key: _plain(value) for key, value in entry.items()}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def _plain(value: Any) -> Any:
    """JSON has no NaN: write null for a value that is not a finite number."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class TensorBoardSink:
    def __init__(self, path: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as error:  # tensorboard is a dependency; a broken install says so
            raise ImportError("TensorBoard logging needs the tensorboard package (pip install tensorboard), "
                              "or set train.tensorboard=false") from error
        self.writer = SummaryWriter(log_dir=str(path / "tensorboard"))

    def write(self, kind: str, values: Mapping[str, Any]) -> None:
        for key, value in numbers(values, skip=("step", "epoch", "epochs_done")).items():
            self.writer.add_scalar(f"{kind}/{key}", value, global_step=int(values["step"]))
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class CSVSink:
    """metrics-<kind>.csv; a record with a key the file has no column for rewrites it with one more
    (rare: the first records of a kind set the columns), so every row stays under its header."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, kind: str, values: Mapping[str, Any]) -> None:
        row = {key: value for key, value in values.items() if isinstance(value, (int, float, str))}
        file = self.path / f"metrics-{kind}.csv"
        rows: List[Dict[str, Any]] = []
        columns: List[str] = []
        if file.exists():
            with open(file, newline="", encoding="utf-8") as handle:
                reader = csv.DictReader(handle)
                columns = list(reader.fieldnames or [])
                if set(row) - set(columns):
                    rows = list(reader)
        added = [key for key in row if key not in columns]
        if file.exists() and not added:
            with open(file, "a", newline="", encoding="utf-8") as handle:
                csv.DictWriter(handle, fieldnames=columns).writerow(row)
            return
        columns += added
        with open(file, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows + [row])

    def close(self) -> None:
        pass


class MLflowSink:
    """Records to an MLflow run; a requeued job, or a new rank 0, goes on with the run it started.

    Args:
        path: the run directory, where the MLflow run's id is kept.
        tracking_uri: MLflow's tracking URI.
        experiment: the experiment the run belongs to (created when missing).
        run_name: the MLflow run's name.
        settings: the job's settings, logged as the run's parameters.
    """
    def __init__(self, path: Path, tracking_uri: str, experiment: str, run_name: str,
                 settings: Mapping[str, Any]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as error:
            raise ImportError("train.loggers=[mlflow] needs MLflow: pip install -e .[mlflow] (mlflow-skinny with "
                              "SQLAlchemy for a sqlite store), or leave mlflow out of train.loggers") from error
        self.client = MlflowClient(tracking_uri=tracking_uri)
        found = self.client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        id_file = path / MLFLOW_RUN_ID_FILE
        if id_file.exists():  # a requeued job, or a new rank 0: the same MLflow run goes on
            self.run_id = id_file.read_text().strip()
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
            id_file.write_text(self.run_id + "\n")
            self._log_settings(settings)

    def _log_settings(self, settings: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [Param(key, str(value)[:6000]) for key, value in flatten(settings).items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])

    def write(self, kind: str, values: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now, step = int(time.time() * 1000), int(values.get("step", 0))
        metrics = [Metric(f"{kind}/{key}", value, now, step) for key, value in numbers(values).items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbSink:
    """Records to an offline W&B run under the run directory (wandb sync uploads it).

    Args:
        path: the run directory.
        project: the W&B project the run belongs to.
        run_name: the W&B run's name.
        settings: the job's settings, the run's config.
    """
    def __init__(self, path: Path, project: str, run_name: str, settings: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError as error:
            raise ImportError("train.loggers=[wandb] needs W&B: pip install -e .[wandb], or leave wandb out of "
                              "train.loggers") from error
        id_file = path / WANDB_RUN_ID_FILE
        # A requeued job (or a new rank 0) continues the run under the same id.
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
        # console="off": W&B would otherwise capture the process's stdout and stderr (the job's own log).
        # No system metrics or machine description: a sampling thread and a probe of the host on
        # rank 0 alone (hvdtrain records memory and throughput itself), which made tests/mpi/
        # test_loggers.py's 2-rank launch take 35 s instead of 10 s on a 2-core machine.
        quiet = wandb.Settings(console="off", silent=True, x_disable_stats=True, x_disable_meta=True,
                               x_disable_machine_info=True)
        self.run = wandb.init(mode="offline", dir=str(path), project=project, name=run_name, id=run_id,
                              resume="allow", config=flatten(settings), reinit="create_new", settings=quiet)
        id_file.write_text(run_id + "\n")

    def write(self, kind: str, values: Mapping[str, Any]) -> None:
        metrics = {f"{kind}/{key}": value for key, value in numbers(values).items()}
        if metrics:
            self.run.log(metrics, step=int(values.get("step", 0)))

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() can return before W&B's service process has written the run's last records to its
        # .wandb file (seen: a file with its header only); teardown waits for the service to end.
        wandb.teardown()


def open_sinks(path: Path, tensorboard: bool, loggers: List[str], run_name: str, settings: Mapping[str, Any],
               mlflow_tracking_uri: Optional[str], mlflow_experiment: str, wandb_project: str = "hvdtrain") -> list:
    """The sinks a run directory's rank 0 writes to.

    Args:
        path: the run directory.
        tensorboard: write TensorBoard events too.
        loggers: train.loggers: csv, mlflow, wandb.
        run_name: the run's name in MLflow and W&B.
        settings: the job's settings, logged with the run.
        mlflow_tracking_uri: MLflow's tracking URI (None: sqlite:///<run_dir>/mlflow.db).
        mlflow_experiment: the MLflow experiment.
        wandb_project: the W&B project.
    """
    sinks: list = [TensorBoardSink(path)] if tensorboard else []
    if "csv" in loggers:
        sinks.append(CSVSink(path))
    if "mlflow" in loggers:
        uri = mlflow_tracking_uri or f"sqlite:///{path.parent.resolve() / 'mlflow.db'}"
        sinks.append(MLflowSink(path, uri, mlflow_experiment, run_name, settings))
    if "wandb" in loggers:
        sinks.append(WandbSink(path, wandb_project, run_name, settings))
    return sinks

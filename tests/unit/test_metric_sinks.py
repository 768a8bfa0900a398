"""Rank 0's records reach every sink it was given: CSV files a column per key (a late key adds one),
an MLflow run read back with MLflow's own client (settings as parameters, records as metrics at
their steps), continued, not duplicated, when the run directory is opened again (a requeue); an
offline W&B run's file decoded with W&B's own record schema."""
import csv
import json
import logging
import time

import pytest
import torch

from hvdtrain.distributed.world import World
from hvdtrain.common.nested import flatten
from hvdtrain.observability.metric_sinks import MLFLOW_RUN_ID_FILE, WANDB_RUN_ID_FILE, open_sinks
from hvdtrain.observability.run_directory import RunDirectory
from tests.wandb_files import wandb_records

SETTINGS = {"train": {"lr": 0.1, "betas": [0.9, 0.95]}, "model": {"width": 8}}


def rank_0():
    return World(rank=0, size=2, local_rank=0, local_size=2, cross_rank=0, cross_size=1, hostname="nodeA",
                 controller="mpi", launcher="test", threads=1, device=torch.device("cpu"))


def run_directory(path, loggers, uri=None):
    return RunDirectory(path, rank_0(), logging.getLogger(f"test.sinks.{path.name}"), tensorboard=False,
                        open_sinks=lambda directory: open_sinks(directory, False, loggers, "run-1", SETTINGS, uri,
                                                                "tests"))


def test_csv_writes_a_row_per_record_and_a_late_key_adds_a_column(tmp_path):
    run = run_directory(tmp_path, ["csv"])
    run.record("step", {"step": 2, "loss": 1.5, "lr": 0.1})
    run.record("step", {"step": 4, "loss": 1.25, "lr": 0.1, "grad_norm": 3.0})
    run.record("epoch", {"step": 4, "epoch": 1.0, "val_loss": 1.1, "per_rank": [{"a": 1}]})
    run.close()

    with open(tmp_path / "metrics-step.csv", newline="") as handle:
        steps = list(csv.DictReader(handle))
    assert steps == [{"step": "2", "loss": "1.5", "lr": "0.1", "grad_norm": ""},
                     {"step": "4", "loss": "1.25", "lr": "0.1", "grad_norm": "3.0"}]
    with open(tmp_path / "metrics-epoch.csv", newline="") as handle:
        assert list(csv.DictReader(handle)) == [{"step": "4", "epoch": "1.0", "val_loss": "1.1"}]


def test_mlflow_holds_the_settings_and_every_record_and_a_reopened_run_goes_on(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = tmp_path / "run-1"
    path.mkdir()
    run = run_directory(path, ["mlflow"], uri)
    run.record("step", {"step": 2, "loss": 1.5, "accuracy": float("nan")})
    run.close()
    again = run_directory(path, ["mlflow"], uri)  # a requeued job opens the same run directory
    again.record("step", {"step": 4, "loss": 1.25})
    again.record("evaluation", {"step": 4, "val_loss": 1.0})
    again.close()

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tests")
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.run_id == (path / MLFLOW_RUN_ID_FILE).read_text().strip()
    assert found.info.run_name == "run-1" and found.info.status == "FINISHED"
    assert found.data.params == {"train.lr": "0.1", "train.betas": "[0.9, 0.95]", "model.width": "8"}
    history = client.get_metric_history(found.info.run_id, "step/loss")
    assert sorted((m.step, m.value) for m in history) == [(2, 1.5), (4, 1.25)]
    assert [m.value for m in client.get_metric_history(found.info.run_id, "evaluation/val_loss")] == [1.0]
    assert client.get_metric_history(found.info.run_id, "step/accuracy") == []  # NaN is not a number to log


def test_wandb_writes_an_offline_run_with_the_settings_and_every_record_and_a_reopened_run_keeps_its_id(tmp_path):
    pytest.importorskip("wandb")
    path = tmp_path / "run-1"
    path.mkdir()
    run = run_directory(path, ["wandb"])
    run.record("step", {"step": 2, "loss": 1.5, "accuracy": float("nan")})
    run.record("evaluation", {"step": 2, "val_loss": 1.0})
    run.close()
    # W&B names an offline run's directory by the second it started and the run's id: a requeued job,
    # seconds later at least, gets its own; one started in the same second would write into the first's.
    time.sleep(1.1)
    again = run_directory(path, ["wandb"])  # a requeued job opens the same run directory
    again.record("step", {"step": 4, "loss": 1.25})
    again.close()

    run_id = (path / WANDB_RUN_ID_FILE).read_text().strip()
    files = sorted((path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [file.name for file in files] == [f"run-{run_id}.wandb"] * 2  # both W&B runs: one id
    logged, runs = [], []
    for file in files:
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                config = {item.key: json.loads(item.value_json) for item in record.run.config.update
                          if item.key != "_wandb"}  # W&B's own entry
                runs.append((record.run.run_id, record.run.project, record.run.display_name, config))
            elif kind == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                logged.append({key: value for key, value in row.items() if not key.startswith("_") or key == "_step"})
    settings = {"train.lr": 0.1, "train.betas": [0.9, 0.95], "model.width": 8}
    assert [(r[0], r[1], r[2]) for r in runs] == [(run_id, "hvdtrain", "run-1")] * 2
    assert all(r[3] == settings for r in runs), runs
    # The NaN accuracy is not a number to log; the evaluation at the same step joins the step's row.
    assert logged == [{"step/loss": 1.5, "evaluation/val_loss": 1.0, "_step": 2}, {"step/loss": 1.25, "_step": 4}], logged


def test_wandb_missing_is_refused_naming_the_extra_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # as if W&B were not installed
    with pytest.raises(ImportError, match=r"train.loggers=\[wandb\] needs W&B: pip install -e \.\[wandb\]"):
        open_sinks(tmp_path, False, ["wandb"], "run-1", SETTINGS, None, "tests")


def test_flatten_names_nested_settings_by_their_path():
    assert flatten(SETTINGS) == {"train.lr": 0.1, "train.betas": [0.9, 0.95], "model.width": 8}

"""train.loggers through the Trainer: rank 0 alone writes, and the CSV rows, the MLflow run and the W&B run hold
the very numbers metrics.jsonl holds."""
import csv
import json
from pathlib import Path

import pytest
import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import small_mlp, synthetic_classification
from tests.wandb_files import wandb_records

# Left out of the Gloo launch at $NP ranks of scripts/run_tests.sh, with the reason (setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skip_gloo(reason="the loggers are rank 0's files: nothing goes through the transport"),
]


def test_csv_mlflow_and_wandb_hold_what_metrics_jsonl_holds(world, tmp_path):
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    base = Path(collectives.allgather_object(str(tmp_path), name="loggers.dir")[0])
    config = TrainConfig(epochs=1, batch_size=4, lr=0.05, warmup_epochs=0, seed=5, max_steps=6, log_every=2,
                         tensorboard=False, run_dir=str(base / "runs"), run_name="logged",
                         loggers=["csv", "mlflow", "wandb"])
    model = small_mlp(seed=0)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr), synthetic_classification(samples=192),
                      synthetic_classification(samples=64), config, world=world)
    trainer.fit()
    trainer.close()
    collectives.allgather_object(None, name="loggers.done")  # every rank closed its files

    if world.is_root:
        run = base / "runs" / "logged"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        losses = [(r["step"], r["loss"]) for r in records if r["kind"] == "step"]
        with open(run / "metrics-step.csv", newline="") as handle:
            rows = [(int(row["step"]), float(row["loss"])) for row in csv.DictReader(handle)]
        client = MlflowClient(tracking_uri=f"sqlite:///{base / 'runs' / 'mlflow.db'}")
        (found,) = client.search_runs([client.get_experiment_by_name("hvdtrain").experiment_id])
        history = sorted((m.step, m.value) for m in client.get_metric_history(found.info.run_id, "step/loss"))
        epoch = client.get_metric_history(found.info.run_id, "epoch/val_loss")
        (wandb_file,) = (run / "wandb").glob("offline-run-*/run-*.wandb")  # one W&B run: rank 0's
        wandb_losses = []
        for record in wandb_records(wandb_file):
            if record.WhichOneof("record_type") == "history":
                row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                if "step/loss" in row:
                    wandb_losses.append((row["_step"], row["step/loss"]))

        assert [step for step, _ in losses] == [2, 4, 6]
        assert rows == losses and history == losses and wandb_losses == losses  # repr round trips: the same floats
        assert [m.value for m in epoch] == [r["val_loss"] for r in records if r["kind"] == "epoch"]
        assert found.data.params["train.loggers"] == "['csv', 'mlflow', 'wandb']"

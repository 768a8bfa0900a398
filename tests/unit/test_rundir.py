import json
import logging

import torch
import yaml

from hvdtrain.distributed.startup import World
from hvdtrain.observability.run_directory import RunDirectory, default_run_name


def world(rank):
    return World(rank=rank, size=2, local_rank=rank, local_size=2, cross_rank=0, cross_size=1,
                 hostname="nodeA", controller="mpi", launcher="test", threads=1, device=torch.device("cpu"))


def test_run_name_is_the_slurm_job_so_a_requeue_appends_else_the_start_time():
    assert default_run_name({"SLURM_JOB_ID": "4711"}) == "slurm-4711"
    assert default_run_name({}, now=0).startswith("19")  # the epoch, in local time


def test_rank_0_writes_config_metrics_and_events_every_rank_its_log(tmp_path):
    logger = logging.getLogger("test.rundir.rank0")
    root = RunDirectory(tmp_path, world(0), logger, tensorboard=True, started=0.0)
    other_logger = logging.getLogger("test.rundir.rank1")
    other_logger.setLevel(logging.INFO)
    other = RunDirectory(tmp_path, world(1), other_logger, tensorboard=True)
    root.write_config({"train": {"epochs": 2}, "model": {"width": 8}})
    other.write_config({"train": {"epochs": 999}})  # only rank 0 writes shared files
    root.record("step", {"step": 10, "epoch": 0.5, "loss": 1.5, "lr": 0.1, "samples_per_sec": 100.0,
                         "comm_fraction": 0.2})
    root.record("epoch", {"step": 20, "epoch": 1.0, "train_loss": float("nan"), "val_accuracy": 0.9})
    other.record("step", {"step": 10, "loss": 9.0})
    other_logger.info("rank 1 saw this")
    root.close()
    other.close()
    other_logger.info("after close: not in the file")

    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"train": {"epochs": 2}, "model": {"width": 8}}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in records] == ["step", "epoch"]
    assert records[0]["loss"] == 1.5 and records[0]["comm_fraction"] == 0.2 and records[0]["elapsed"] > 0
    assert records[1]["train_loss"] is None  # JSON has no NaN
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    rank1_log = (tmp_path / "logs" / "rank-1.log").read_text()
    assert "rank 1@nodeA INFO rank 1 saw this" in rank1_log and "after close" not in rank1_log
    assert (tmp_path / "logs" / "rank-0.log").exists()


def test_a_run_started_again_appends(tmp_path):
    for step in (10, 20):
        run = RunDirectory(tmp_path, world(0), logging.getLogger("test.rundir.append"), tensorboard=False)
        run.record("step", {"step": step, "loss": 1.0})
        run.close()
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10, 20] and not (tmp_path / "tensorboard").exists()

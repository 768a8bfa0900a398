"""A checkpoint directory belongs to one run: nothing of another run is resumed, pruned or mixed in,
and a failed save is an error on every rank (each case here failed before run identity existed)."""
import subprocess
import sys

import pytest
import torch

from hvdtrain.checkpoint.formats.full import CheckpointStore
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.fault_tolerance.elastic import ElasticState
from hvdtrain.trainer import Trainer
from hvdtrain.components.position import Position
from hvdtrain.components.precision import Precision
from tests.mpi.helpers import checkpoint_names as names, outcome, small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi


def trainer(world, directory, **settings):
    values = dict(epochs=4, batch_size=4, lr=0.05, warmup_epochs=0, seed=3, checkpoint_dir=str(directory),
                  checkpoint_every=10, log_every=1000)
    values.update(settings)
    config = TrainConfig(**values)
    model = small_mlp(0)
    # 960 samples: no epoch ends (and saves) before step 60 at up to 4 ranks, only the steps asked for.
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr), synthetic_classification(960), None,
                   config, world=world)


STEPS_10_20_30 = ["ckpt-000000010.pt", "ckpt-000000020.pt", "ckpt-000000030.pt"]


def test_a_new_run_over_another_runs_checkpoints_is_refused_and_deletes_nothing(world, shared_tmp_path):
    """resume=false on a directory with checkpoints used to write among them, prune them by step
    number (its own step 4 and 8 went first) and point `latest` at its step 12."""
    first = trainer(world, shared_tmp_path, max_steps=30)
    first.fit()
    first.close()
    messages = outcome(lambda: trainer(world, shared_tmp_path, resume=False, max_steps=12, checkpoint_every=4),
                       "identity.fresh")
    assert all(m and "holds checkpoints already (newest: ckpt-000000030.pt)" in m for m in messages), messages
    assert names(shared_tmp_path) == STEPS_10_20_30
    assert (shared_tmp_path / "latest").read_text().strip() == "ckpt-000000030.pt"


def test_a_checkpoint_of_other_settings_is_refused_unless_forced(world, shared_tmp_path):
    """A learning-rate sweep sharing one checkpoint_dir used to resume each other's weights."""
    first = trainer(world, shared_tmp_path, max_steps=30)
    first.fit()
    first.close()
    messages = outcome(lambda: trainer(world, shared_tmp_path, lr=0.1, max_steps=40), "identity.settings")
    assert all(m and "train.lr: 0.05 -> 0.1" in m and "train.resume=force" in m for m in messages), messages
    forced = trainer(world, shared_tmp_path, lr=0.1, max_steps=40, resume="force")
    resumed_at = forced.global_step
    forced.close()
    # Settings that may change between a run and its resume (its length, the strategy) are accepted.
    longer = trainer(world, shared_tmp_path, max_steps=50, strategy="zero1")
    longer_at = longer.global_step
    longer.close()
    assert (resumed_at, longer_at) == (30, 30)


def test_a_newer_unreadable_checkpoint_never_displaces_what_the_run_writes(world, shared_tmp_path):
    """keep_checkpoints=1 used to keep the unreadable newest step and delete each save just written;
    the unreadable one is set aside at the start that finds it, under a name no run reads or prunes."""
    first = trainer(world, shared_tmp_path, max_steps=20)
    first.fit()
    first.close()
    if world.is_root:
        (shared_tmp_path / "ckpt-000000030.pt").write_bytes(b"not a checkpoint")
    collectives.barrier()
    second = trainer(world, shared_tmp_path, max_steps=24, checkpoint_every=2, keep_checkpoints=1)
    resumed_at = second.global_step
    second.fit()
    second.close()
    third = trainer(world, shared_tmp_path, max_steps=30)
    third_at = third.global_step
    third.close()
    assert resumed_at == 20 and third_at == 24
    assert names(shared_tmp_path) == ["ckpt-000000024.pt", "ckpt-000000030.pt.corrupt"]
    assert (shared_tmp_path / "latest").read_text().strip() == "ckpt-000000024.pt"


def test_a_second_live_run_is_refused_on_every_rank_naming_the_owner(world, shared_tmp_path):
    holder = None
    if world.is_root:  # another process owns the directory, alive until it is told to stop
        holder = subprocess.Popen(
            [sys.executable, "-c", "import logging, sys; from hvdtrain.checkpoint.ownership import Ownership; "
             f"Ownership.claim({str(shared_tmp_path)!r}, logging.getLogger()); print('owned', flush=True); "
             "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "owned"
    pid = collectives.broadcast_object(holder.pid if holder else None, root_rank=0, name="identity.holder")
    try:
        messages = outcome(lambda: trainer(world, shared_tmp_path, max_steps=10), "identity.live")
    finally:
        if holder is not None:
            holder.communicate("", timeout=30)
    assert all(m and "is in use by a live run" in m and f"pid {pid} on " in m for m in messages), messages
    # Its end lets the directory go: the next run owns it.
    collectives.barrier()
    after = trainer(world, shared_tmp_path, max_steps=10)
    after.fit()
    after.close()
    assert names(shared_tmp_path) == ["ckpt-000000010.pt"]


def test_a_failed_full_save_is_raised_on_every_rank(world, shared_tmp_path, monkeypatch):
    """It used to raise on rank 0 alone while the others waited at a barrier: a hang."""
    def disk_full(self, state, step):
        raise OSError(28, "No space left on device")
    if world.is_root:
        monkeypatch.setattr(CheckpointStore, "save", disk_full)
    run = trainer(world, shared_tmp_path, max_steps=10)
    messages = outcome(run.fit, "identity.save")
    run.close()
    assert all(m and "No space left on device" in m for m in messages), messages


@pytest.mark.timeout(60)
def test_the_fp16_loss_scale_is_part_of_the_elastic_state(world):
    """A worker joining under Horovod elastic used to keep its own loss scale."""
    model = small_mlp(world.rank)
    precision = Precision("fp16", world.device)
    precision.scale, precision.good_steps = 2.0 ** (10 + world.rank), world.rank
    state = ElasticState(model, torch.optim.SGD(model.parameters(), lr=0.1), Position(), precision,
                         on_reset=lambda: None, on_sync=[])
    state.sync()
    synced = (precision.scale, precision.good_steps)
    precision.scale = 3.0
    state.restore()  # a rollback returns to the synced scale
    rows = collectives.allgather_object((synced, precision.scale), name="identity.elastic")
    assert rows == [((2.0 ** 10, 0), 2.0 ** 10)] * world.size, rows

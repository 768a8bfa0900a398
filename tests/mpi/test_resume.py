"""Stopping after step k and resuming from the checkpoint gives bitwise the run that never stopped;
a corrupt newest checkpoint is set aside and the one before resumed."""
import logging
from pathlib import Path

import pytest
import torch
from torch import nn

from hvdtrain.distributed import collectives, rng
from hvdtrain.config.train import TrainConfig
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import flat_parameters, synthetic_classification

pytestmark = pytest.mark.mpi


def dropout_mlp(seed):
    torch.manual_seed(seed)
    # Dropout draws from each rank's own generator: exact resume must restore every rank's state.
    return nn.Sequential(nn.Linear(12, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 4)).double()


def build(world, directory, max_steps, model_seed=0):
    model = dropout_mlp(model_seed)
    config = TrainConfig(epochs=5, batch_size=4, accumulation=2, lr=0.05, warmup_epochs=0.5, seed=9,
                         max_steps=max_steps, checkpoint_dir=directory, log_every=1000)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9),
                   synthetic_classification(samples=192), None, config, world=world)


def train(world, directory, max_steps, model_seed=0):
    trainer = build(world, directory, max_steps, model_seed)
    trainer.fit()
    return trainer


def test_resume_mid_epoch_continues_bitwise(world, tmp_path):
    base = collectives.allgather_object(str(tmp_path), name="resume.dir")[0]  # rank 0 writes and reads
    rng.seed_everything(rng.rank_seed(1, world.rank))
    whole = train(world, f"{base}/whole", max_steps=20)

    rng.seed_everything(rng.rank_seed(1, world.rank))
    stopped = train(world, f"{base}/stopped", max_steps=7)
    stopped_at = (stopped.parts.position.epoch, stopped.parts.position.epoch_position)
    rng.seed_everything(12345 + world.rank)  # the resumed run must not depend on the RNG it starts with
    resumed = train(world, f"{base}/stopped", max_steps=20, model_seed=99)

    rows = collectives.allgather_rows(flat_parameters(resumed.model) - flat_parameters(whole.model), name="resume.diff")
    assert stopped_at[1] != 0, "the stop must fall inside an epoch to test mid-epoch resume"
    assert resumed.global_step == whole.global_step == 20
    assert torch.count_nonzero(rows) == 0, f"max difference per rank: {rows.abs().max(dim=1).values.tolist()}"


def test_a_corrupt_newest_full_checkpoint_is_set_aside_and_the_previous_one_resumed(world, tmp_path):
    """A bit flipped in the newest full checkpoint (its size unchanged) resumed silently: torch.load
    reads a changed tensor without a word. Rank 0 now checks its checksum, names it, sets it aside,
    and every rank resumes the one before."""
    base = collectives.allgather_object(str(tmp_path), name="resume.corrupt.dir")[0]
    train(world, f"{base}/ckpt", max_steps=3)
    train(world, f"{base}/ckpt", max_steps=6)
    newest = Path(base) / "ckpt" / "ckpt-000000006.pt"
    problem = None
    if world.is_root:
        data = bytearray(newest.read_bytes())
        data[len(data) // 2] ^= 0x10
        newest.write_bytes(bytes(data))
    lines = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger(f"hvdtrain.rank{world.rank}")  # the ranks' loggers do not propagate
    logger.addHandler(handler)
    try:
        started = build(world, f"{base}/ckpt", max_steps=8).global_step
    except Exception as error:  # noqa: BLE001 - compared on every rank below
        problem = repr(error)
    finally:
        logger.removeHandler(handler)
    outcomes = collectives.allgather_object([started if problem is None else problem], name="resume.corrupt")

    assert outcomes == [[3]] * world.size, f"every rank resumes step 3: {outcomes}"
    assert (Path(base) / "ckpt" / "ckpt-000000006.pt.corrupt").is_file() and not newest.exists()
    if world.is_root:
        assert any(f"the checkpoint {newest} is corrupt ({newest} does not match" in line
                   and "set aside as ckpt-000000006.pt.corrupt" in line for line in lines), lines

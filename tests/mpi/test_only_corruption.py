"""Only corruption is corruption: a checkpoint whose bytes are as written is never set aside, a run
that cannot read one stops naming why, and a run never starts over from step 0 where checkpoints
were. Each case here, on the code before, set good checkpoints aside one after another and trained
from step 0 with resume=true, exiting 0.

Every test runs all its collectives (through the Trainer, or ``outcome``) before it asserts, and
takes the same path on every rank; the faults are made on rank 0, which reads a full checkpoint.
"""
import errno
import pickle
from pathlib import Path

import numpy
import pytest
import torch

from hvdtrain import Callback
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import checkpoint_names as names, outcome, small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi


class BestMetric(Callback):
    """A "best metric" callback as users write them: numpy numbers and arrays in its state."""

    def __init__(self, value=None):
        self.best, self.history = numpy.float64("inf"), numpy.zeros(3, dtype=numpy.float32)
        self.count, self.value = numpy.int64(0), value

    def on_step_end(self, trainer, step):
        self.count += 1
        self.best = min(self.best, numpy.float64(1.0 / (step + 1)))
        self.history[step % 3] = step

    def state_dict(self):
        state = {"best": self.best, "history": self.history, "count": self.count}
        if self.value is not None:
            state["extra"] = self.value
        return state

    def load_state_dict(self, state):
        self.best, self.history, self.count = state["best"], state["history"], state["count"]


def trainer(world, directory, callbacks=(), **settings):
    values = dict(epochs=4, batch_size=4, lr=0.05, warmup_epochs=0, seed=3, checkpoint_dir=str(directory),
                  checkpoint_every=10, log_every=1000, tensorboard=False)
    values.update(settings)
    config = TrainConfig(**values)
    model = small_mlp(0)
    return Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr), synthetic_classification(960), None,
                   config, world=world, callbacks=list(callbacks))


# Each format as its strategies write it: the full one gathered to rank 0, the sharded one a file per rank.
FORMATS = [pytest.param({"checkpoint_format": "full"}, id="full"),
           pytest.param({"checkpoint_format": "sharded", "strategy": "zero1"}, id="sharded")]


@pytest.mark.parametrize("layout", FORMATS)
def test_a_callback_holding_numpy_numbers_resumes_its_state_and_nothing_is_set_aside(world, shared_tmp_path, layout):
    first_callback = BestMetric()
    first = trainer(world, shared_tmp_path, [first_callback], max_steps=20, **layout)
    first.fit()
    first.close()
    resumed_callback = BestMetric()
    second = trainer(world, shared_tmp_path, [resumed_callback], max_steps=20, **layout)
    resumed_at = second.global_step
    second.close()
    written = names(shared_tmp_path)
    collectives.barrier()
    assert resumed_at == 20
    assert not any(".corrupt" in name for name in written), written
    assert type(resumed_callback.best) is numpy.float64 and resumed_callback.best == first_callback.best
    assert resumed_callback.history.dtype == numpy.float32
    assert resumed_callback.history.tolist() == first_callback.history.tolist()
    assert type(resumed_callback.count) is numpy.int64 and resumed_callback.count == 20


@pytest.mark.parametrize("layout", FORMATS)
def test_a_state_that_would_not_load_back_is_refused_at_save_naming_it(world, shared_tmp_path, layout):
    import datetime

    run = trainer(world, shared_tmp_path, [BestMetric(datetime.datetime(2026, 11, 28))], max_steps=20, **layout)
    messages = outcome(run.fit, "corruption.refused_at_save")
    run.close()
    written = names(shared_tmp_path)
    collectives.barrier()
    assert all(m and "['extra'] is a datetime.datetime" in m and "which a resume could not read back" in m
               for m in messages), messages
    assert written == [], written  # nothing half-written: the save was refused before a byte


def full_run_then(world, directory):
    """Steps 10 and 20 saved in the full format; every rank then sees them."""
    first = trainer(world, directory, max_steps=20)
    first.fit()
    first.close()
    collectives.barrier()


FAILURES = {
    "out of memory": RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: not enough memory: "
                                  "you tried to allocate 70000000000 bytes."),
    "an I/O error": OSError(errno.EIO, "Input/output error"),
    "a stale handle": OSError(errno.ESTALE, "Stale file handle"),
    "a type refused": pickle.UnpicklingError("Weights only load failed. WeightsUnpickler error: Unsupported global: "
                                             "GLOBAL pandas.Timestamp was not an allowed global by default."),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_a_checkpoint_that_cannot_be_read_stops_every_rank_and_nothing_is_set_aside(world, shared_tmp_path,
                                                                                    monkeypatch, failure):
    full_run_then(world, shared_tmp_path)
    if world.is_root:
        def failing(*args, **kwargs):
            raise FAILURES[failure]
        monkeypatch.setattr(torch, "load", failing)
    messages = outcome(lambda: trainer(world, shared_tmp_path, max_steps=30), "corruption.unreadable")
    monkeypatch.undo()
    written = names(shared_tmp_path)
    collectives.barrier()
    assert all(m and "ckpt-000000020.pt" in m and "nothing was set aside" in m for m in messages), messages
    assert written == ["ckpt-000000010.pt", "ckpt-000000020.pt"]


def test_a_checksum_file_the_file_system_fails_to_read_sets_nothing_aside(world, shared_tmp_path, monkeypatch):
    full_run_then(world, shared_tmp_path)
    if world.is_root:
        real = Path.read_text

        def failing(path, *args, **kwargs):
            if path.name.endswith(".checksum"):
                raise OSError(errno.EIO, "Input/output error")
            return real(path, *args, **kwargs)
        monkeypatch.setattr(Path, "read_text", failing)
    messages = outcome(lambda: trainer(world, shared_tmp_path, max_steps=30), "corruption.checksum_eio")
    monkeypatch.undo()
    written = names(shared_tmp_path)
    collectives.barrier()
    assert all(m and "ckpt-000000020.pt.checksum could not be read: the file system failed" in m for m in messages), \
        messages
    assert written == ["ckpt-000000010.pt", "ckpt-000000020.pt"]


def test_where_every_checkpoint_is_corrupt_the_run_refuses_to_start_over(world, shared_tmp_path):
    """Both checkpoints damaged: each is set aside, and the run refuses rather than train from step 0;
    the next start refuses too (only what was set aside is left); resume=false starts anew."""
    full_run_then(world, shared_tmp_path)
    if world.is_root:
        for name in ("ckpt-000000010.pt", "ckpt-000000020.pt"):
            path = shared_tmp_path / name
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 0xFF
            path.write_bytes(bytes(data))
    collectives.barrier()
    first = outcome(lambda: trainer(world, shared_tmp_path, max_steps=30), "corruption.all_corrupt")
    again = outcome(lambda: trainer(world, shared_tmp_path, max_steps=30), "corruption.all_corrupt.again")
    anew = trainer(world, shared_tmp_path, max_steps=10, resume="false")
    anew_at = anew.global_step
    anew.fit()
    anew.close()
    written = names(shared_tmp_path)
    collectives.barrier()
    for messages in (first, again):
        assert all(m and "holds only checkpoints set aside (ckpt-000000010.pt.corrupt, ckpt-000000020.pt.corrupt)"
                   in m and "train.resume=false" in m for m in messages), messages
    assert anew_at == 0
    assert written == ["ckpt-000000010.pt", "ckpt-000000010.pt.corrupt", "ckpt-000000020.pt.corrupt"]

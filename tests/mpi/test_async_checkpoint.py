"""train.checkpoint_async across ranks: a background save writes exactly what a synchronous save of
the same step writes (while training goes on, changing the live tensors), the end of the run waits
for the last write, and a write that fails in the background is raised on every rank at the next
save, naming the rank and the cause, with the previous checkpoint still the newest."""
import time
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.formats.full import CheckpointStore, checkpoint_name
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import synthetic_classification
from tests.mpi.test_fsdp import FEATURES
from tests.mpi.test_sharded_checkpoint import WithExtras, shared_directory
from tests.mpi.test_zero import MICRO_BATCH, two_groups

pytestmark = pytest.mark.mpi

CASES = [("ddp", "full"), ("zero2", "full"), ("zero2", "sharded"), ("fsdp", "sharded")]
MAX_STEPS = 6


def trainer(world, strategy, checkpoint_format, directory, asynchronous, max_steps=MAX_STEPS):
    model = WithExtras(seed=3)
    config = TrainConfig(epochs=5, batch_size=MICRO_BATCH, lr=0.01, warmup_epochs=0.5, seed=9, strategy=strategy,
                         max_steps=max_steps, checkpoint_dir=directory, checkpoint_every=2, log_every=1000,
                         checkpoint_format=checkpoint_format, checkpoint_async=asynchronous, progress="off")
    return Trainer(model, torch.optim.AdamW(two_groups(model)),
                   synthetic_classification(samples=192, features=FEATURES, classes=5), None, config, world=world)


def largest_difference(ours, theirs) -> float:
    """max |ours - theirs| over every tensor of two nested states; inf where their structure or a
    plain value differs."""
    if isinstance(ours, torch.Tensor):
        if not isinstance(theirs, torch.Tensor) or ours.shape != theirs.shape or ours.dtype != theirs.dtype:
            return float("inf")
        if ours.dtype in (torch.uint8, torch.int64, torch.bool):
            return 0.0 if torch.equal(ours, theirs) else float("inf")
        return (ours.double() - theirs.double()).abs().max().item() if ours.numel() else 0.0
    if isinstance(ours, dict):
        if not isinstance(theirs, dict) or set(ours) != set(theirs):
            return float("inf")
        return max([largest_difference(ours[k], theirs[k]) for k in ours], default=0.0)
    if isinstance(ours, (list, tuple)):
        if not isinstance(theirs, (list, tuple)) or len(ours) != len(theirs):
            return float("inf")
        return max([largest_difference(a, b) for a, b in zip(ours, theirs)], default=0.0)
    return 0.0 if ours == theirs else float("inf")


def written_at(directory: str, checkpoint_format: str, step: int, rank: int):
    """What the checkpoint of ``step`` holds for this rank: the full file, or the manifest's run
    state (without the files' sha256s: torch.save's bytes may differ) and this rank's file. The
    job's config and its claim of the directory are left out: each run's are its own."""
    if checkpoint_format == "full":
        written = CheckpointStore.read(Path(directory) / checkpoint_name(step))
    else:
        path = Path(directory) / sharded.directory_name(step)
        manifest = sharded.read_manifest(path)
        # Each run's claim of its directory ("lease") is its own.
        written = {**{k: v for k, v in manifest.items() if k not in ("files", "path", "lease")},
                   "shard": sharded.read_shard(path, manifest, rank)}
    assert written["config"]["train"]["checkpoint_dir"] == directory
    return {key: value for key, value in written.items() if key != "config"}


def writes_after_the_next_step(monkeypatch, steps_taken) -> None:
    """The background writer begins only once training has taken the next step (or ended): had a
    save handed the live tensors to the writer instead of a copy, its file would hold later values."""
    save, write_shard = CheckpointStore.save, sharded.write_shard

    def after_the_next_step(step: int) -> None:
        deadline = time.monotonic() + 60  # never a hang: a slow machine just writes sooner
        while steps_taken() <= step and step < MAX_STEPS and time.monotonic() < deadline:
            time.sleep(0.005)

    def delayed_save(store, state, step):
        after_the_next_step(step)
        return save(store, state, step)

    def delayed_shard(temporary, *args):
        after_the_next_step(int(sharded.LEFTOVER.match(temporary.name).group(1)))
        return write_shard(temporary, *args)
    monkeypatch.setattr(CheckpointStore, "save", delayed_save)
    monkeypatch.setattr(sharded, "write_shard", delayed_shard)


@pytest.mark.parametrize("strategy,checkpoint_format", CASES, ids=[f"{s}-{f}" for s, f in CASES])
def test_a_background_save_writes_what_a_synchronous_save_writes(world, tmp_path, monkeypatch, strategy,
                                                                 checkpoint_format):
    base = shared_directory(world, tmp_path, f"async.{strategy}.{checkpoint_format}")
    runs = {}
    for asynchronous in (False, True):
        directory = f"{base}/{'async' if asynchronous else 'sync'}"
        run = trainer(world, strategy, checkpoint_format, directory, asynchronous)
        if asynchronous:
            writes_after_the_next_step(monkeypatch, lambda: run.parts.position.step)
        run.fit()  # returns once the step-6 checkpoint is written: it is read below without waiting
        run.close()
        runs[asynchronous] = directory
    monkeypatch.undo()
    differences = [largest_difference(written_at(runs[True], checkpoint_format, step, world.rank),
                                      written_at(runs[False], checkpoint_format, step, world.rank))
                   for step in (2, 4, 6)]
    rows = collectives.allgather_object(differences, name=f"async.test.{strategy}.{checkpoint_format}")
    # Both runs train alike: a sum of 2 ranks' gradients is the same in either order, and the sharded
    # strategies reduce each bucket in one call. Beyond 2 ranks ddp's tensor fusion groups gradients
    # by timing, so the ring may add them in another order: about 1e-16 per step (float64).
    bound = 0.0 if world.size <= 2 or strategy != "ddp" else 1e-12
    assert all(d <= bound for row in rows for d in row), f"max |async - sync| per rank, steps 2, 4, 6: {rows}"


def fail_when_writing(step, rank, monkeypatch, world):
    """This rank's writes of ``step``'s checkpoint fail as on a full disk."""
    if world.rank != rank:
        return
    write_shard, save = sharded.write_shard, CheckpointStore.save

    def full_disk():
        raise OSError(28, "No space left on device")

    def failing_shard(temporary, *args):
        failing = temporary.name.startswith(f".{sharded.directory_name(step)}.tmp")  # .tmp-<the claim's token>
        return full_disk() if failing else write_shard(temporary, *args)

    def failing_save(store, state, written_step):
        return full_disk() if written_step == step else save(store, state, written_step)
    monkeypatch.setattr(sharded, "write_shard", failing_shard)
    monkeypatch.setattr(CheckpointStore, "save", failing_save)


@pytest.mark.parametrize("checkpoint_format,failing_rank", [("full", 0), ("sharded", 1)])
def test_a_background_write_that_fails_is_raised_on_every_rank_at_the_next_save(world, tmp_path, monkeypatch,
                                                                                 checkpoint_format, failing_rank):
    failing_rank = min(failing_rank, world.size - 1)
    base = shared_directory(world, tmp_path, f"async.failure.{checkpoint_format}")
    fail_when_writing(4, failing_rank, monkeypatch, world)
    run = trainer(world, "zero2", checkpoint_format, f"{base}/ckpt", asynchronous=True)
    try:
        run.fit()
        outcome = f"trained to step {run.global_step}"
    except CheckpointError as error:
        outcome = f"{str(error)} (at step {run.global_step})"
    run.close()
    outcomes = collectives.allgather_object(outcome, name=f"async.test.failure.{checkpoint_format}")
    newest = CheckpointStore(f"{base}/ckpt").steps()[0][0]

    assert len(set(outcomes)) == 1, f"the ranks did not agree: {outcomes}"
    assert f"rank {failing_rank}: OSError: [Errno 28] No space left on device" in outcomes[0], outcomes[0]
    assert outcomes[0].endswith("(at step 6)"), f"raised at the next save (step 6): {outcomes[0]}"
    assert newest == 2, f"step 4 failed and step 6 was not written: the newest must be 2, not {newest}"

"""hsdp's sharded checkpoints (train.strategy=hsdp, checkpoint_format=sharded): the ranks of the first shard
group (0..K-1) write their slices of the units' flat buffers as element ranges of the parameters they cut,
the Adam moments alike, rank 0 the tensors outside the buffers; the other shard groups, whose slices are
copies, write their RNG states only. Nothing is gathered, and the checkpoint

- holds every element of the model and of the optimizer's per-element state once over the files, and
  no model or optimizer data in the files of ranks K..N-1,
- continues bitwise at its own layout (hsdp K=2) to an uninterrupted run's state,
- is resumed under fsdp (every rank), ddp, zero1 and hsdp at K=N to exactly the state written,
- consolidates (``hvdtrain checkpoint consolidate``) to the state the full format holds, and passes
  ``hvdtrain checkpoint verify``.

test_sharded_checkpoint's model (Blocks with a buffer and a frozen parameter, float64, two AdamW groups),
K = train.hsdp_shard_size = 2: at 4 ranks two simulated hosts of two, at 2 ranks one shard group (fsdp's
layout). "Exactly": torch.equal, since a checkpoint moves values and never computes with them.
"""
import copy
from pathlib import Path

import pytest
import torch

from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.formats.full import CheckpointStore
from hvdtrain.cli import main as cli
from hvdtrain.distributed import collectives, rng
from tests.mpi.helpers import synthetic_classification
from tests.mpi.test_fsdp import FEATURES
from tests.mpi.test_mesh_checkpoint import differences
from tests.mpi.test_zero import MICRO_BATCH

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets,
              pytest.mark.np4(reason="2 simulated hosts x 2 ranks: a second shard group whose ranks write no slices")]

STEPS = 3


def trainer(world, strategy, directory, max_steps, shard_size=2, checkpoint_format="sharded", seed=99):
    """test_hsdp's Trainer (test_sharded_checkpoint's model), hsdp at ``shard_size``."""
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.trainer import Trainer
    from tests.mpi.test_sharded_checkpoint import WithExtras
    from tests.mpi.test_zero import two_groups

    model = WithExtras(seed)
    config = TrainConfig(epochs=5, batch_size=MICRO_BATCH, accumulation=2, lr=0.01, warmup_epochs=0.5, seed=9,
                         strategy=strategy, max_steps=max_steps, checkpoint_dir=str(directory), log_every=1000,
                         checkpoint_format=checkpoint_format, progress="off",
                         hsdp_shard_size=shard_size if strategy == "hsdp" else 0)
    return Trainer(model, torch.optim.AdamW(two_groups(model)),
                   synthetic_classification(samples=192, features=FEATURES, classes=5), None, config, world=world)


def gathered(run):
    """The whole state as a gathered checkpoint holds it; the run's process sets closed."""
    state = copy.deepcopy(run.strategy.state_dict())
    run.close_mesh()
    return state


def read_files(checkpoint, saved, directory):
    """What one process finds in ``checkpoint``: per rank the model tensors and optimizer entries its file
    holds, the names whose elements the files do not hold exactly once, and the consolidated checkpoint's
    differences from ``saved`` (with the CLI's exit codes)."""
    files = sorted(checkpoint.glob("rank-*.pt"))
    parts = [torch.load(file, weights_only=True)["strategy"] for file in files]
    held = [(len(part["model"]), sum(len(entries) for entries in part["optimizer"]["state"].values()))
            for part in parts]
    names = list(saved["model"])
    not_once = [name for name in names
                if sum(part["model"][name].numel() for part in parts if name in part["model"])
                != saved["model"][name].numel()]
    for index, state in saved["optimizer"]["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim():
                count = sum(part["optimizer"]["state"][index][key].numel() for part in parts
                            if key in part["optimizer"]["state"].get(index, {}))
                if count != value.numel():
                    not_once.append(f"optimizer {index}.{key}")
    codes = [cli(["checkpoint", "consolidate", str(checkpoint), "--out", str(directory / "whole.pt")]),
             cli(["checkpoint", "verify", str(checkpoint)])]
    return {"files": len(files), "held": held, "not_once": not_once, "codes": codes,
            "consolidated": differences(CheckpointStore.read(directory / "whole.pt"), saved)}


def on_root(world, action):
    """``action()`` on rank 0, its outcome (or failure) on every rank."""
    seen = None
    if world.is_root:
        try:
            seen = action()
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            seen = {"error": f"{type(error).__name__}: {error}"}
    return collectives.broadcast_object(seen, root_rank=0, name="hsdp_checkpoint.root")


def resumed_from(world, checkpoint, directory, strategy, **settings):
    """The gathered state of a run of ``strategy`` resuming ``checkpoint`` (linked into a directory of its own),
    and the step it resumed at; another model on every rank, which the load must overwrite."""
    if world.is_root:
        directory.mkdir()
        (directory / checkpoint.name).symlink_to(checkpoint, target_is_directory=True)
    collectives.barrier()
    run = trainer(world, strategy, directory, STEPS, seed=300 + world.rank, **settings)
    return run.global_step, gathered(run)


def resumes(world):
    """The layouts that fit this world, resuming: fsdp over every rank, ddp (full format), zero1, hsdp at K=N."""
    found = {"fsdp": ("fsdp", {}), "ddp": ("ddp", {"checkpoint_format": "full"}), "zero1": ("zero1", {})}
    if world.size > 2:
        found[f"hsdp-K{world.size}"] = ("hsdp", {"shard_size": world.size})
    return found


@pytest.mark.timeout(600)
def test_hsdps_sharded_checkpoint_holds_every_element_once_continues_bitwise_and_reshards(world, shared_tmp_path):
    if world.size % 2:
        pytest.skip("hsdp at K=2 needs an even world")
    directory = shared_tmp_path / "ckpt"
    rng.seed_everything(rng.rank_seed(1, world.rank))
    written = trainer(world, "hsdp", directory, STEPS)
    written.fit()
    label = written.strategy.label
    saved = gathered(written)
    checkpoint = directory / sharded.directory_name(STEPS)
    manifest = on_root(world, lambda: sharded.read_manifest(checkpoint))
    # The same layout continues, to an uninterrupted run's state.
    continued = trainer(world, "hsdp", directory, 2 * STEPS, seed=200)
    started = continued.global_step
    continued.fit()
    after_resume = gathered(continued)
    rng.seed_everything(rng.rank_seed(1, world.rank))
    uninterrupted = trainer(world, "hsdp", shared_tmp_path / "uninterrupted", 2 * STEPS)
    uninterrupted.fit()
    straight = gathered(uninterrupted)
    continued_off = differences(after_resume, straight)
    moved = max((after_resume["model"][name] - saved["model"][name]).abs().max().item() for name in saved["model"])
    resumed = {}
    for name, (strategy, settings) in resumes(world).items():
        step, state = resumed_from(world, checkpoint, shared_tmp_path / f"resume-{name}", strategy, **settings)
        resumed[name] = (step, differences(state, saved))
    seen = on_root(world, lambda: read_files(checkpoint, saved, shared_tmp_path))

    assert label == f"hsdp 2 x {world.size // 2}"
    assert manifest["strategy"] == "hsdp" and manifest["world_size"] == world.size, manifest
    assert "error" not in seen, seen
    assert seen["files"] == world.size
    assert all(model and optimizer for model, optimizer in seen["held"][:2]), seen["held"]
    assert all(held == (0, 0) for held in seen["held"][2:]), \
        f"ranks 2.. (copies of the first shard group's slices) wrote model or optimizer data: {seen['held']}"
    assert seen["not_once"] == [], f"not held exactly once over the files: {seen['not_once']}"
    assert started == STEPS and moved > 1e-4, (started, moved)
    assert continued_off == [], f"continued at hsdp K=2, off an uninterrupted run: {continued_off}"
    for name, (step, off) in resumed.items():
        assert step == STEPS and off == [], f"resumed under {name} at step {step}, off the written state: {off}"
    assert seen["codes"] == [0, 0], f"consolidate, verify exit codes: {seen['codes']}"
    assert seen["consolidated"] == [], f"consolidated, off the full state: {seen['consolidated']}"

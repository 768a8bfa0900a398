"""Sharded checkpoints over a tensor x pipeline mesh: every rank writes only what it alone writes of
the state (its slices, its stage; nothing gathered), and the checkpoint

- continues bitwise at its own layout (each rank's RNG from its own file),
- is resumed under another mesh and under the flat strategies (fsdp, zero2, ddp), and a flat
  strategy's sharded checkpoint under a mesh, to exactly the state that was written,
- consolidates, and exports one tensor at a time (``hvdtrain export``), to exactly that state.

The example transformer in float64. "Exactly": every comparison is torch.equal, because a
checkpoint moves values and never computes with them; continuing training is bitwise too (the
same operations in the same order as the run that was not stopped)."""
import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from hvdtrain.checkpoint.consolidate import consolidate
from hvdtrain.cli import main as cli
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.examples.textlm import lm_loss
from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.trainer import Trainer
from tests.mpi.test_model_parallel import make_model, token_data

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.np4(reason="T=2 x P=2 and the 2-replica layouts fit only at 4 (its 2-rank run is Gloo's too)"),
]

BATCH, STEPS, SEED = 4, 2, 7
# (tensor, pipeline, strategy): what writes the checkpoint, and what resumes it.
LAYOUTS = [(2, 1, "ddp"), (1, 2, "ddp"), (2, 2, "ddp"), (1, 1, "zero2")]
TARGETS = [(2, 1, "zero1"), (1, 2, "ddp"), (1, 1, "fsdp"), (1, 1, "ddp")]


def layout_id(layout):
    tensor, pipeline, strategy = layout
    return f"T{tensor}-P{pipeline}-{strategy}"


def fits(world, layout) -> bool:
    tensor, pipeline, _ = layout
    return world.size % (tensor * pipeline) == 0 and (tensor * pipeline > 1 or world.size > 1)


def trainer_for(world, layout, directory, max_steps, checkpoint_every=0):
    tensor, pipeline, strategy = layout
    model = make_model(100 + world.rank)  # different on every rank: set-up must broadcast rank 0's
    config = TrainConfig(epochs=1, batch_size=BATCH, scale_lr=False, warmup_epochs=0, max_steps=max_steps,
                         seed=SEED, log_every=1000, tensor_parallel=tensor, pipeline_parallel=pipeline,
                         micro_batches=2 if pipeline > 1 else 1, strategy=strategy,
                         checkpoint_dir=str(directory), checkpoint_format="sharded" if strategy != "ddp" or
                         tensor * pipeline > 1 else "full", checkpoint_every=checkpoint_every)
    plan = ModelPlan(tensor_plan=tensor_plan(model), pipeline_layers=pipeline_layers) if tensor * pipeline > 1 else None
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), token_data(), None, config, world=world,
                   loss_fn=lm_loss, model_plan=plan)


def gathered(trainer):
    """The whole state as a gathered checkpoint holds it, and the trainer's mesh closed."""
    state = copy.deepcopy(trainer.strategy.state_dict())
    if trainer.parts.topology.mesh is not None:
        trainer.close_mesh()  # left open, every later test's collectives slow down
    return state


def differences(ours, theirs):
    """Names whose tensors are not bit for bit the same, model and optimizer state."""
    wrong = [name for name in theirs["model"] if not torch.equal(ours["model"][name], theirs["model"][name])]
    for index, state in theirs["optimizer"]["state"].items():
        for key, value in state.items():
            mine = ours["optimizer"]["state"].get(index, {}).get(key)
            same = torch.equal(mine, value) if isinstance(value, torch.Tensor) else mine == value
            if not same:
                wrong.append(f"optimizer {index}.{key}")
    return wrong


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_a_sharded_checkpoint_resumes_under_every_layout_exactly(world, layout, shared_tmp_path):
    if not fits(world, layout) or world.size == 1:
        pytest.skip(f"{layout_id(layout)} needs more ranks than {world.size}, or another world")
    directory = shared_tmp_path / "ckpt"
    # Written: STEPS steps, checkpointed at the end; then the same layout continues to 2 x STEPS.
    written = trainer_for(world, layout, directory, STEPS)
    written.fit()
    saved = gathered(written)
    checkpoint = directory / f"ckpt-{STEPS:09d}"
    files = sorted(p.name for p in checkpoint.iterdir()) if checkpoint.is_dir() else []
    continued = trainer_for(world, layout, directory, 2 * STEPS)
    continued.fit()
    after_resume = gathered(continued)
    uninterrupted = trainer_for(world, layout, shared_tmp_path / "uninterrupted", 2 * STEPS)
    uninterrupted.fit()
    straight = gathered(uninterrupted)
    # Every other layout that fits resumes the checkpoint of step STEPS (copied: the continuation
    # above wrote a newer one) and holds exactly its state.
    resumed = {}
    for target in TARGETS:
        if fits(world, target) and target != layout:
            copy_dir = shared_tmp_path / f"resume-{layout_id(target)}"
            if world.is_root:
                copy_dir.mkdir()
                (copy_dir / checkpoint.name).symlink_to(checkpoint, target_is_directory=True)
            collectives.barrier()
            trainer = trainer_for(world, target, copy_dir, STEPS)
            trainer.fit()
            resumed[layout_id(target)] = differences(gathered(trainer), saved)
    # One process reads the files: consolidated, and exported a tensor at a time.
    consolidated = exported = None
    if world.is_root:
        full = consolidate(checkpoint)
        consolidated = differences(full, saved)
        assert cli(["export", str(checkpoint), "--out", str(shared_tmp_path / "export")]) == 0
        weights = load_file(str(shared_tmp_path / "export" / "model.safetensors"))
        exported = sorted(name for name, value in saved["model"].items() if not torch.equal(weights[name], value))
        manifest = json.loads((checkpoint / "manifest.json").read_text())
    consolidated, exported, manifest = collectives.broadcast_object(
        (consolidated, exported, manifest if world.is_root else None), root_rank=0, name="mesh_checkpoint.read")

    tensor, pipeline, _ = layout
    assert files == ["manifest.json"] + [f"rank-{r:05d}-of-{world.size:05d}.pt" for r in range(world.size)]
    assert manifest["mesh"] == [world.size // (tensor * pipeline), pipeline, tensor]
    assert differences(after_resume, straight) == [], "the continued run left the uninterrupted one"
    assert resumed and all(wrong == [] for wrong in resumed.values()), resumed
    assert consolidated == [] and exported == []


@pytest.mark.timeout(120)
def test_no_rank_writes_more_than_its_part(world, shared_tmp_path):
    """Each element of the state is in exactly one rank's file: the files together are the state's
    size, and under T=2 a split matrix's slice is half of it (the second data replica, at 4 ranks,
    writes nothing of the model: the first one's ranks write it)."""
    if world.size % 2:
        pytest.skip("T=2 needs an even world")
    trainer = trainer_for(world, (2, 1, "ddp"), shared_tmp_path / "ckpt", STEPS)
    trainer.fit()
    data_rank = trainer.parts.topology.mesh.coordinates.data
    saved = gathered(trainer)
    checkpoint = shared_tmp_path / "ckpt" / f"ckpt-{STEPS:09d}"
    part = torch.load(checkpoint / f"rank-{world.rank:05d}-of-{world.size:05d}.pt", weights_only=True)["strategy"]
    held = sum(t.numel() for t in part["model"].values())
    halves = [part["model"][name].numel() * 2 == saved["model"][name].numel() for name in part["model_shards"]]
    every = collectives.allgather_object((data_rank, held, halves), name="mesh_checkpoint.held")
    whole = sum(t.numel() for t in saved["model"].values())

    assert sum(count for _, count, _ in every) == whole, f"the files hold {every} model elements, the model {whole}"
    assert all(count == 0 for data, count, _ in every if data > 0)
    assert all(halves and all(halves) for data, _, halves in every if data == 0)

"""Your own loop's state at a path of your choosing, clipping in the loop and export, as Accelerate
and Fabric offer them: save_state(path) / load_state(path) continuing bitwise under every kind of
strategy and checkpoint format, clip_grad_norm_ giving exactly train.max_grad_norm's steps, export
writing the whole model, and several models refused. At 1, 2 and 4 ranks.
"""
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import hvdtrain
from hvdtrain.checkpoint import CheckpointError
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from tests.mpi.helpers import small_mlp, synthetic_classification

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank: the state is all one rank's"),
    pytest.mark.np4(reason="sharded states cut four ways"),
]

# Dropout-free and float64; 48 samples at 2 per rank: 6 steps fit in an epoch at 4 ranks too.
SETTINGS = dict(epochs=2, batch_size=2, seed=5, log_every=1000, progress="off")


def session(world, config, lr=0.01):
    model = small_mlp(3)
    return hvdtrain.setup(model, torch.optim.AdamW(model.parameters(), lr=lr), synthetic_classification(samples=48),
                          config, world=world)


def train(hv, until_step, clip=None):
    for _ in hv.epochs(until_step=until_step):
        for inputs, targets in hv.batches():
            hv.backward(F.cross_entropy(hv.model(inputs), targets))
            if clip is not None:
                hv.clip_grad_norm_(clip)
            hv.step()


def owned(hv):
    """This rank's parameters and optimizer moments as the strategy holds them (its shards under zero/fsdp)."""
    optimizer_state = [t.reshape(-1) for s in hv.optimizer.state.values() for t in s.values() if t.dim() > 0]
    return torch.cat([p.detach().reshape(-1) for p in hv.strategy.owned_parameters()] + optimizer_state)


def differing(a, b, name):
    """Elements differing, per rank (gathered before any assertion: every rank asserts alike)."""
    return collectives.allgather_object(torch.count_nonzero(a - b).item() if a.shape == b.shape else -1, name=name)


@pytest.mark.parametrize("strategy,checkpoint_format", [
    ("ddp", "full"), ("zero1", "sharded"), ("zero2", "full"), ("fsdp", "sharded"), ("fsdp", "full"),
])
def test_save_state_at_a_path_and_load_state_continue_bitwise(world, shared_tmp_path, strategy, checkpoint_format):
    config = TrainConfig(strategy=strategy, checkpoint_format=checkpoint_format, **SETTINGS)
    path = shared_tmp_path / "mine"
    first = session(world, config)
    counters = {"seen": 0}
    first.keep(counters=counters)
    train(first, until_step=3)
    counters["seen"] = 3
    first.save_state(path)
    train(first, until_step=6)

    second = session(world, config, lr=0.5)  # another rate too: the loaded schedule must set it back
    mine = {"seen": 0}
    second.keep(counters=mine)
    second.load_state(path)
    assert second.global_step == 3 and mine == {"seen": 3}
    train(second, until_step=6)

    assert differing(owned(first), owned(second), f"loop_state.{strategy}.{checkpoint_format}") == [0] * world.size
    assert second.global_step == 6
    # The checkpoint contract's files: step 3's checkpoint (a file, or a sharded one's directory) and latest.
    written = sorted(p.name for p in path.iterdir())
    assert "latest" in written and any(name.startswith("ckpt-000000003") for name in written), written


def test_load_state_refuses_an_empty_directory_and_save_state_the_runs_own(world, shared_tmp_path):
    own = shared_tmp_path / "own"
    hv = session(world, TrainConfig(checkpoint_dir=str(own), **SETTINGS))
    with pytest.raises(CheckpointError, match="no checkpoint there; save_state\\(path\\) writes one"):
        hv.load_state(shared_tmp_path / "empty")
    with pytest.raises(ValueError, match="is train.checkpoint_dir, which this run owns: use save\\(\\)"):
        hv.save_state(own)
    hv.close()


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp"])
def test_clip_grad_norm_in_the_loop_steps_exactly_as_max_grad_norm(world, strategy):
    # Accumulation 2: the clip must wait for the last micro-batch and the reduced gradients.
    settings = dict(SETTINGS, strategy=strategy, accumulation=2)
    configured = session(world, TrainConfig(max_grad_norm=0.05, **settings))
    train(configured, until_step=3)
    in_loop = session(world, TrainConfig(**settings))
    train(in_loop, until_step=3, clip=0.05)
    unclipped = session(world, TrainConfig(**settings))
    train(unclipped, until_step=3)

    name = f"loop_state.clip.{strategy}"
    assert differing(owned(configured), owned(in_loop), name) == [0] * world.size
    assert in_loop.grad_norm == configured.grad_norm > 0.05  # the norm was clipped, not under the bound
    assert min(differing(owned(configured), owned(unclipped), name + ".unclipped")) > 0  # clipping changed it
    with pytest.raises(ValueError, match="train.max_grad_norm=0.05 clips every step already.*set "
                                         "train.max_grad_norm=null"):
        configured.clip_grad_norm_(1.0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_export_writes_the_whole_trained_model_from_rank_0(world, shared_tmp_path, strategy):
    hv = session(world, TrainConfig(strategy=strategy, **SETTINGS))
    train(hv, until_step=2)
    hv.export(shared_tmp_path / "export")
    whole = {name: tensor.clone() for name, tensor in hv.strategy.exported_model_state().items()}
    written = load_file(shared_tmp_path / "export" / "model.safetensors") if world.rank == 0 else None
    ok = collectives.broadcast_object(
        None if written is None else (sorted(written) == sorted(small_mlp(3).state_dict())
                                      and all(torch.equal(written[k], whole[k]) for k in written)),
        root_rank=0, name=f"loop_state.export.{strategy}")
    assert ok
    assert not torch.equal(whole["0.weight"], small_mlp(3).state_dict()["0.weight"])  # trained, not the start


def test_several_models_or_optimizers_are_refused_naming_what_to_do(world):
    generator, discriminator = small_mlp(3), small_mlp(4)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (generator, discriminator)]
    data = synthetic_classification(samples=48)
    with pytest.raises(TypeError, match="a list, not an nn.Module: several models or optimizers .* not supported.*"
                                        "hv.prepare_model\\(teacher\\) after setup"):
        hvdtrain.setup([generator, discriminator], optimizers[0], data, TrainConfig(**SETTINGS), world=world)
    with pytest.raises(TypeError, match="a list, not a torch.optim.Optimizer: .*one nn.Module and one optimizer"):
        hvdtrain.setup(generator, optimizers, data, TrainConfig(**SETTINGS), world=world)


def test_prepare_model_gives_every_rank_rank_0s_frozen_teacher_which_training_leaves_alone(world):
    hv = session(world, TrainConfig(strategy="fsdp", **SETTINGS))
    teacher = hv.prepare_model(small_mlp(10 + world.rank))  # each rank builds other weights: rank 0's win
    assert not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    before = torch.cat([p.detach().reshape(-1) for p in teacher.parameters()])
    for _ in hv.epochs(until_step=2):
        for inputs, targets in hv.batches():
            with torch.no_grad():
                soft = F.softmax(teacher(inputs), dim=1)
            outputs = hv.model(inputs)
            hv.backward(F.cross_entropy(outputs, targets) + F.cross_entropy(outputs, soft))
            hv.step()
    after = torch.cat([p.detach().reshape(-1) for p in teacher.parameters()])
    rank0 = torch.cat([p.detach().reshape(-1) for p in small_mlp(10).parameters()])
    assert differing(after, rank0, "loop_state.teacher") == [0] * world.size
    assert torch.equal(before, after) and hv.global_step == 2

    with pytest.raises(ValueError, match="the session's optimizer trains its parameters"):
        hv.prepare_model(hv.model)
    if world.size > 1:  # one rank builds another model: refused on every rank, before any broadcast
        other = small_mlp(10, classes=5 if world.rank == world.size - 1 else 4)
        with pytest.raises(ValueError, match=f"ranks \\[{world.size - 1}\\] built a model whose state names, "
                                             f"shapes or dtypes differ"):
            hv.prepare_model(other)

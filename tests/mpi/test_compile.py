"""train.compile: the model's forward through torch.compile (Inductor, C++ kernels on CPU) trains
what the same run without it trains, under every strategy that accepts it, and keeps the plain
state_dict keys in what it exports; fsdp is refused on every rank, with the reason.

Bound: float64. Compiled kernels fuse operations (the bias add with tanh, log-softmax with the
loss, their backward) and may sum in another order than eager's kernels (a bias's gradient over the
batch), so each value differs by a few units in the last place, ~1e-16 relative; measured here over
4 steps: at most 1.1e-16. 1e-10 is far above that and far below what a gradient reduced wrongly or
not at all changes (1e-3 and more, as in test_loop_features.py).

Time: the first test compiles for real (~10-25 s on 2 busy cores, two graphs: training, and
evaluation without autograd); the later ones trace the same graphs, which Inductor's on-disk cache
serves, so they take a few seconds each.
"""
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from hvdtrain import dist
from hvdtrain.config import TrainConfig
from tests.mpi.helpers import flat_parameters, small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi

BOUND = 1e-10  # see the module's docstring
BATCH, STEPS, SEED = 4, 4, 11


def config(strategy, **overrides):
    return TrainConfig(epochs=1, batch_size=BATCH, strategy=strategy, scale_lr=False, warmup_epochs=0,
                       max_steps=STEPS, seed=SEED, log_every=1000, progress="off", tensorboard=False, **overrides)


def agreed(values, name):
    """Every rank's row of values (a collective: call it before asserting)."""
    return dist.allgather_rows(torch.as_tensor(values, dtype=torch.float64).reshape(1, -1), name=name)


def train(world, strategy, compile, run_dir):
    """A run through the Trainer; the trained model, its final metrics, and how many graphs Dynamo compiled."""
    from hvdtrain.trainer import Trainer

    data = synthetic_classification(samples=96)
    model = small_mlp(seed=600 + world.rank)  # an nn.Sequential: torch 2.13's model.compile() skips it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    torch._dynamo.reset()  # or the previous test's compiled forward (same class, same shapes) is reused
    graphs = counters["stats"]["unique_graphs"]
    name = f"{strategy}-{'compiled' if compile else 'eager'}"
    trainer = Trainer(model, optimizer, data, synthetic_classification(samples=40), world=world,
                      config=config(strategy, compile=compile, run_dir=str(run_dir), run_name=name))
    final = trainer.run()
    assert trainer.model is model, "the Trainer trains the module it was given, not a wrapper"  # local
    return trainer.model, final, counters["stats"]["unique_graphs"] - graphs, run_dir / name / "model.safetensors"


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2"])
def test_compiled_run_trains_what_the_eager_run_trains(world, strategy, tmp_path):
    from safetensors.torch import load_file

    # Rank 0's directory, which every rank reads (pytest-mpi's mpi_tmp_path is per rank under Gloo).
    shared = Path(dist.allgather_object(str(tmp_path), name=f"compile.{strategy}.dir")[0])
    eager, eager_final, _, _ = train(world, strategy, False, shared)
    compiled, compiled_final, graphs, exported = train(world, strategy, True, shared)
    ours, theirs = flat_parameters(compiled), flat_parameters(eager)
    rows = agreed([(ours - theirs).abs().max(), (ours - flat_parameters(small_mlp(seed=0))).abs().max(),
                   abs(compiled_final["val_loss"] - eager_final["val_loss"]), graphs], name=f"compile.{strategy}")
    replicas = dist.allgather_rows(ours.reshape(1, -1), name=f"compile.{strategy}.params")
    dist.barrier()  # rank 0 wrote the export before its run() returned
    exported_state = load_file(str(exported))

    assert (rows[:, 3] >= 1).all(), "Dynamo compiled nothing: the run was eager, the test proves nothing"
    assert (rows[:, 0] < BOUND).all(), f"max |compiled - eager| per rank: {rows[:, 0].tolist()}"
    assert (rows[:, 1] > 1e-3).all(), "the parameters did not move: the test proves nothing"
    assert (rows[:, 2] < BOUND).all(), f"validation loss, compiled - eager: {rows[:, 2].tolist()}"
    assert all(torch.equal(replicas[0], row) for row in replicas), "ranks hold different parameters"
    # Checkpoints and the export keep the plain keys (no _orig_mod. prefix) and the trained values.
    assert list(compiled.state_dict()) == list(eager.state_dict())
    assert sorted(exported_state) == sorted(eager.state_dict())  # safetensors sorts the keys
    assert all(torch.equal(exported_state[key], value) for key, value in compiled.state_dict().items())


def test_fsdp_refuses_compile_on_every_rank(world):
    with pytest.raises(ValueError) as refused:
        config("fsdp", compile=True)
    message = str(refused.value)
    said = agreed([float(all(word in message for word in ("fsdp", "Horovod's collectives", "ddp, zero1 or zero2")))],
                  name="compile.fsdp.refused")

    assert (said[:, 0] == 1).all(), f"not every rank gave the reason: {message}"

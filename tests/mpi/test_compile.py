"""train.compile: the model's forward through torch.compile (Inductor, C++ kernels on CPU) trains
what the same run without it trains, under every strategy that accepts it, and keeps the plain
state_dict keys in what it exports; fsdp is refused on every rank, with the reason. The models:
a small MLP, and a CNN of the digits CNN's shape, whose convolutions get zero gradients from
torch 2.13's Inductor on CPU unless hvdtrain turns its layout optimization off (hvdtrain.components.compiling).

Bound: float64. Compiled kernels fuse operations (the bias add with tanh, log-softmax with the
loss, their backward) and may sum in another order than eager's kernels (a bias's gradient over the
batch), so each value differs by a few units in the last place, ~1e-16 relative; measured over 4
steps: 5.6e-17 (the MLP, every strategy), 2.8e-17 (the CNN); 1.1e-16 with Adam over 6 steps. 1e-10
is far above that and far below what a gradient reduced wrongly or not at all changes (1e-3 and
more, as in test_loop_features.py; the CNN's zero convolution gradients: 5.5e-3).

Time, with Inductor's on-disk cache empty, on 2 cores shared with other jobs (load 9): the MLP
compiles for real, 67 s (two graphs: training; evaluation without autograd); the CNN 47 s; zero1
and zero2 compile the MLP's graphs again, which that cache serves: 3-5 s each, so all three
strategies are kept. With the cache warm the whole file takes ~45 s at 2 ranks, ~10 s at 1.
"""

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import counters
from torch.utils.data import TensorDataset

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from tests.mpi.helpers import agreed, flat_parameters, small_mlp, synthetic_classification

# Left out of the Gloo launch at $NP ranks of scripts/run_tests.sh, with the reason (setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skip_gloo(reason="torch.compile's cost is Inductor's: its ddp all-reduces are test_strategies' under "
                                 "Gloo too"),
]

BOUND = 1e-10  # see the module's docstring
BATCH, STEPS, SEED = 4, 4, 11


def config(strategy, batch_size=BATCH, **overrides):
    return TrainConfig(epochs=1, batch_size=batch_size, strategy=strategy, scale_lr=False, warmup_epochs=0,
                       max_steps=STEPS, seed=SEED, log_every=1000, progress="off", tensorboard=False, **overrides)


def small_cnn(seed):
    """The digits CNN's shape (1 -> 32 -> 64 channels, max-pool, two dense layers), in float64: with
    Inductor's layout optimization on, torch 2.13 computes zero gradients for its convolutions at
    batch 16 (not at 4, 8 or 64: which shapes it hits looks arbitrary)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 16, 32), nn.ReLU(), nn.Linear(32, 4)).double()


def images(samples):
    inputs, labels = synthetic_classification(samples=samples, features=64).tensors
    return TensorDataset(inputs.reshape(-1, 1, 8, 8), labels)


# model, data, batch per worker, training samples (4 steps at up to 4 workers)
MODELS = {"mlp": (small_mlp, synthetic_classification, BATCH, 96), "cnn": (small_cnn, images, 16, 256)}


def train(world, strategy, kind, compile, run_dir):
    """A run through the Trainer; the trained model, its final metrics, and how many graphs Dynamo compiled."""
    from hvdtrain.trainer import Trainer

    build, dataset, batch, samples = MODELS[kind]
    model = build(seed=600 + world.rank)  # nn.Sequential: torch 2.13's model.compile() would skip it
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    torch._dynamo.reset()  # or the previous test's compiled forward (same class, same shapes) is reused
    graphs = counters["stats"]["unique_graphs"]
    name = f"{strategy}-{kind}-{'compiled' if compile else 'eager'}"
    trainer = Trainer(model, optimizer, dataset(samples), dataset(40), world=world,
                      config=config(strategy, batch, compile=compile, run_dir=str(run_dir), run_name=name))
    final = trainer.run()
    assert trainer.model is model, "the Trainer trains the module it was given, not a wrapper"  # local
    return trainer.model, final, counters["stats"]["unique_graphs"] - graphs, run_dir / name / "model.safetensors"


# The CNN under ddp only: what it checks is in the compiled kernels, which the strategy does not change.
@pytest.mark.parametrize("strategy,kind", [("ddp", "mlp"), ("zero1", "mlp"), ("zero2", "mlp"), ("ddp", "cnn")])
def test_compiled_run_trains_what_the_eager_run_trains(world, strategy, kind, shared_tmp_path):
    from safetensors.torch import load_file

    shared = shared_tmp_path
    eager, eager_final, _, _ = train(world, strategy, kind, False, shared)
    compiled, compiled_final, graphs, exported = train(world, strategy, kind, True, shared)
    ours, theirs = flat_parameters(compiled), flat_parameters(eager)
    rows = agreed([(ours - theirs).abs().max(), (ours - flat_parameters(MODELS[kind][0](seed=0))).abs().max(),
                   abs(compiled_final["val_loss"] - eager_final["val_loss"]), graphs], name=f"compile.{strategy}.{kind}")
    replicas = collectives.allgather_rows(ours.reshape(1, -1), name=f"compile.{strategy}.{kind}.params")
    collectives.barrier()  # rank 0 wrote the export before its run() returned
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

"""Sharded checkpoints (train.checkpoint_format=sharded) under zero1, zero2 and fsdp: each rank
writes its own part, a resume on the same worker count and strategy continues bitwise, the parts
consolidate into exactly the full state the strategy gathers, and a checkpoint resumes under another
strategy as its consolidation does (resharded on load)."""
import copy
import io
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from hvdtrain.distributed import collectives, rng
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.consolidate import consolidate
from hvdtrain.config.train import TrainConfig
from hvdtrain.strategies import build_strategy
from hvdtrain.strategies.sharding.shard_state import assemble_full_state
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import flat_parameters, synthetic_classification
from tests.mpi.test_fsdp import FEATURES, Blocks, flat
from tests.mpi.test_zero import MICRO_BATCH, state_difference, two_groups
from tests.mpi.test_zero import zero_steps as train_steps  # the Trainer's loop, by hand

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="a sharded checkpoint of a single part"),
    pytest.mark.np4(reason="each rank's part of the checkpoint, and the resharding between strategies, change with "
                           "the world size"),
    pytest.mark.gloo_np4(reason="the same parts at 4 ranks over Gloo"),
]

SHARDED = ("zero1", "zero2", "fsdp")


class WithExtras(Blocks):
    """Blocks (three units, odd sizes, so every world size > 1 pads), with what a rank keeps whole
    besides its slices: a buffer and a frozen parameter, both used in forward."""

    def __init__(self, seed: int, hidden: int = 6) -> None:
        super().__init__(seed=seed, hidden=hidden)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, FEATURES, dtype=torch.float64))
        self.frozen = nn.Parameter(torch.full((FEATURES,), 0.1, dtype=torch.float64), requires_grad=False)

    def forward(self, x):
        return super().forward(x * self.scale + self.frozen)


def adamw(model):
    return torch.optim.AdamW(two_groups(model))  # two groups: own lr and weight decay each


def strategy_for(name, world, seed):
    model = WithExtras(seed)
    return build_strategy(TrainConfig(strategy=name), model, adamw(model), world)


def full_model(strategy):
    """A copy of the full model state (a collective under fsdp; under zero, views of live buffers)."""
    return copy.deepcopy(strategy.state_dict()["model"])


def same_model(ours, theirs) -> bool:
    return list(ours) == list(theirs) and all(
        ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in theirs)


def through_a_file(state):
    """What torch.save writes and torch.load(weights_only=True) reads back."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("name", SHARDED)
def test_a_strategy_resumes_bitwise_from_its_own_part_and_the_parts_consolidate_exactly(world, name):
    data = synthetic_classification(samples=192, features=FEATURES, classes=5)
    original = strategy_for(name, world, seed=0)
    original.broadcast_from_root()
    train_steps(original, data, 2, 1, world)
    own = through_a_file(original.shard_state_dict())
    every_part = collectives.allgather_object(own, name=f"sharded.test.parts.{name}")
    gathered = copy.deepcopy(original.state_dict())  # the full format (zero's model: views of live buffers)

    resumed = strategy_for(name, world, seed=7)  # another initialisation, a fresh optimizer
    resumed.broadcast_from_root()
    resumed.check_shard_state_dict(own)
    resumed.load_shard_state_dict(own)
    after_load = full_model(resumed)
    train_steps(original, data, 2, 1, world, first=2)
    train_steps(resumed, data, 2, 1, world, first=2)
    continued, resumed_state = copy.deepcopy(original.state_dict()), resumed.state_dict()

    rebuilt = assemble_full_state(every_part)
    local = torch.tensor([
        float(same_model(after_load, gathered["model"])),
        float(same_model(resumed_state["model"], continued["model"])),
        state_difference(resumed_state["optimizer"], continued["optimizer"]),
        float(same_model(rebuilt["model"], gathered["model"])),
        state_difference(rebuilt["optimizer"], gathered["optimizer"]),
        (flat(continued["model"]) - flat(gathered["model"])).abs().max().item(),
    ], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name=f"sharded.test.result.{name}")

    slices = sum(part.numel() for part in own["params"])
    assert slices == sum(b.padded_numel for b in original.buckets) // world.size, "a rank must hold only its slices"
    assert (everywhere[:, 5] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, 0] == 1).all(), "the loaded model differs from the saved one"
    assert (everywhere[:, 1] == 1).all(), "the resumed run's model differs from the uninterrupted one"
    assert (everywhere[:, 2] == 0).all(), f"resumed optimizer state: max |difference| {everywhere[:, 2].tolist()}"
    assert (everywhere[:, 3] == 1).all(), "the consolidated model differs from the gathered state_dict()"
    assert (everywhere[:, 4] == 0).all(), f"consolidated optimizer state: max |difference| {everywhere[:, 4].tolist()}"


def trainer(world, strategy, directory, max_steps, model_seed=0, checkpoint_format="sharded", model=None):
    model = WithExtras(model_seed) if model is None else model
    config = TrainConfig(epochs=5, batch_size=MICRO_BATCH, accumulation=2, lr=0.01, warmup_epochs=0.5, seed=9,
                         strategy=strategy, max_steps=max_steps, checkpoint_dir=directory, log_every=1000,
                         checkpoint_format=checkpoint_format, progress="off")
    optimizer = torch.optim.AdamW(two_groups(model))
    return Trainer(model, optimizer, synthetic_classification(samples=192, features=FEATURES, classes=5), None,
                   config, world=world)


def fit(world, strategy, directory, max_steps, **kwargs):
    run = trainer(world, strategy, directory, max_steps, **kwargs)
    run.fit()
    return run


def shared_directory(world, tmp_path, name):
    return collectives.allgather_object(str(tmp_path), name=f"sharded.test.dir.{name}")[0]  # rank 0's


@pytest.mark.parametrize("name", SHARDED)
def test_a_stopped_trainer_resumes_from_its_sharded_checkpoint_bitwise(world, tmp_path, name):
    base = shared_directory(world, tmp_path, f"resume.{name}")
    rng.seed_everything(rng.rank_seed(1, world.rank))
    whole = fit(world, name, f"{base}/whole", max_steps=10)
    gathered = copy.deepcopy(whole.state_dict())  # every rank, before any assertion
    newest = Path(f"{base}/whole/{sharded.directory_name(10)}")
    rebuilt = consolidate(newest)  # in this process, from the files and the manifest

    fit(world, name, f"{base}/stopped", max_steps=3)
    rng.seed_everything(12345 + world.rank)  # the resumed run must not depend on the RNG it starts with
    resumed = fit(world, name, f"{base}/stopped", max_steps=10, model_seed=99)
    whole.strategy.whole_model()
    resumed.strategy.whole_model()
    difference = (flat_parameters(resumed.model) - flat_parameters(whole.model)).abs().max().reshape(1)
    rows = collectives.allgather_rows(difference, name=f"sharded.test.resume.{name}")
    checks = collectives.allgather_object([same_model(rebuilt["model"], gathered["model"]),
                                          state_difference(rebuilt["optimizer"], gathered["optimizer"])],
                                         name=f"sharded.test.consolidated.{name}")

    manifest = json.loads((newest / sharded.MANIFEST).read_text())
    assert sorted(p.name for p in newest.iterdir()) == \
        [sharded.MANIFEST] + [sharded.shard_name(r, world.size) for r in range(world.size)]
    assert (manifest["strategy"], manifest["world_size"], manifest["step"]) == (name, world.size, 10)
    assert resumed.global_step == whole.global_step == 10
    assert (rows == 0).all(), f"max |resumed - uninterrupted| per rank: {rows.flatten().tolist()}"
    assert all(model for model, _ in checks), "the consolidated model differs from the gathered state_dict()"
    assert all(difference == 0 for _, difference in checks), f"consolidated optimizer state: {checks}"
    assert rebuilt["step"] == 10 and rebuilt["world_size"] == world.size and len(rebuilt["rng"]) == world.size


def test_a_consolidated_checkpoint_resumes_under_another_strategy(world, tmp_path):
    """zero2 writes sharded, consolidate makes the full file beside it, ddp resumes from it."""
    base = shared_directory(world, tmp_path, "consolidated")
    whole = fit(world, "ddp", None, max_steps=8, checkpoint_format="full")
    fit(world, "zero2", f"{base}/ckpt", max_steps=4)
    newest = Path(f"{base}/ckpt/{sharded.directory_name(4)}")
    on_root(world, lambda: torch.save(consolidate(newest), f"{base}/ckpt/{newest.name}.pt"))
    resumed = fit(world, "ddp", f"{base}/ckpt", max_steps=8, model_seed=5, checkpoint_format="full")
    difference = (flat_parameters(resumed.model) - flat_parameters(whole.model)).abs().max().reshape(1)
    rows = collectives.allgather_rows(difference, name="sharded.test.consolidated")

    assert resumed.global_step == 8
    # float64: ZeRO sums the gradients in another order than ddp's all-reduce (1e-16 per step).
    assert (rows < 1e-10).all(), f"max |resumed - uninterrupted| per rank: {rows.flatten().tolist()}"


def on_root(world, action) -> None:
    """Rank 0 does ``action``; its failure fails every rank here, not later in mismatched collectives."""
    problem = None
    if world.is_root:
        try:
            action()
        except Exception as error:  # noqa: BLE001 - reported on every rank below
            problem = repr(error)
    problem = collectives.broadcast_object(problem, root_rank=0, name="sharded.test.on_root")
    assert problem is None, f"rank 0 failed: {problem}"


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


RESHARDED = [("zero2", "fsdp"), ("fsdp", "zero1"), ("zero1", "zero2"), ("zero2", "ddp")]


def flat_state(strategy) -> torch.Tensor:
    """The model's and the optimizer's whole state as one float64 row (a collective when sharded)."""
    state = strategy.state_dict()
    optimizer = state["optimizer"]["state"]
    tensors = [value for value in state["model"].values()] + [
        optimizer[index][key] for index in sorted(optimizer) for key in sorted(optimizer[index])
        if isinstance(optimizer[index][key], torch.Tensor)]
    return torch.cat([tensor.detach().reshape(-1).to(torch.float64) for tensor in tensors])


@pytest.mark.parametrize("written,resumed", RESHARDED, ids=[f"{a}-{b}" for a, b in RESHARDED])
def test_a_sharded_checkpoint_resumes_under_another_strategy_as_its_consolidation_does(world, tmp_path, written,
                                                                                     resumed):
    """Resharded on load (each rank reading its own part in its own layout, or ddp the whole state)
    holds bitwise the state the same checkpoint consolidated and loaded holds, and trains on from it."""
    base = shared_directory(world, tmp_path, f"resharded.{written}.{resumed}")
    fit(world, written, f"{base}/direct", max_steps=3)
    newest = sharded.directory_name(3)
    on_root(world, lambda: shutil.copytree(f"{base}/direct", f"{base}/consolidated"))
    on_root(world, lambda: torch.save(consolidate(Path(f"{base}/consolidated/{newest}")),
                                      f"{base}/consolidated/{newest}.pt"))  # the full file wins at the same step
    runs, started, loaded = [], [], []
    for directory in ("direct", "consolidated"):
        rng.seed_everything(rng.rank_seed(1, world.rank))
        run = trainer(world, resumed, f"{base}/{directory}", max_steps=6, model_seed=99,
                      checkpoint_format="full" if resumed == "ddp" else "sharded")
        started.append(run.global_step)
        loaded.append(flat_state(run.strategy))
        run.fit()
        run.strategy.whole_model()
        runs.append(run)
    at_load = (loaded[0] - loaded[1]).abs().max().reshape(1)
    trained = (flat_parameters(runs[0].model) - flat_parameters(runs[1].model)).abs().max().reshape(1)
    rows = collectives.allgather_rows(torch.cat([at_load, trained]), name=f"sharded.test.resharded.{written}.{resumed}")
    assert started == [3, 3] and runs[0].global_step == runs[1].global_step == 6
    assert (rows[:, 0] == 0).all(), f"max |resharded - consolidated| state at load per rank: {rows[:, 0].tolist()}"
    # The sharded strategies reduce each bucket in one call, in a fixed order: bitwise. ddp's
    # gradients go through Horovod's tensor fusion, which groups tensors as they become ready, so
    # the ring sums an element in a timing-dependent order: float64, 1 ulp per step (about 1e-16).
    bound = 1e-12 if resumed == "ddp" else 0.0
    assert (rows[:, 1] <= bound).all(), f"max |resharded - consolidated| after training per rank: {rows[:, 1].tolist()}"


class Lines(logging.Handler):
    """What a logger said, line by line (the ranks' loggers do not propagate to pytest's capture)."""

    def __init__(self, world):
        super().__init__(logging.INFO)
        self.lines, self.logger = [], logging.getLogger(f"hvdtrain.rank{world.rank}")

    def emit(self, record):
        self.lines.append(record.getMessage())

    def __enter__(self):
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeHandler(self)


def test_a_corrupt_newest_checkpoint_is_set_aside_and_the_previous_one_resumed(world, tmp_path):
    """A bit flipped in the last rank's file of the newest checkpoint (its size unchanged): the ranks
    verify their shares of its files, agree it is corrupt, rank 0 names the file and sets the
    checkpoint aside, and every rank resumes the one before (it stopped every restart: the good one
    beside it was never tried)."""
    base = shared_directory(world, tmp_path, "corrupt")
    fit(world, "fsdp", f"{base}/ckpt", max_steps=2)
    fit(world, "fsdp", f"{base}/ckpt", max_steps=4)
    newest = Path(f"{base}/ckpt/{sharded.directory_name(4)}")
    victim = newest / sharded.shard_name(world.size - 1, world.size)
    on_root(world, lambda: flip_a_byte(victim))
    with Lines(world) as log:
        try:
            outcome = trainer(world, "fsdp", f"{base}/ckpt", max_steps=6).global_step
        except sharded.CheckpointError as error:
            outcome = str(error)
    outcomes = collectives.allgather_object(outcome, name="sharded.test.corrupt")
    aside = Path(f"{base}/ckpt/{sharded.directory_name(4)}.corrupt")

    assert outcomes == [2] * world.size, f"every rank resumes step 2: {outcomes}"
    assert aside.is_dir() and not newest.exists() and (aside / victim.name).is_file()
    if world.is_root:
        warned = [line for line in log.lines if "is corrupt" in line]
        assert len(warned) == 1 and f"{victim} does not match" in warned[0], log.lines
        assert f"set aside as {aside.name}" in warned[0], warned
        assert f"resuming from {Path(base) / 'ckpt' / sharded.directory_name(2)}" in log.lines


@pytest.mark.parametrize("hidden", [4, 9], ids=["smaller", "larger"])
@pytest.mark.parametrize("written,resumed", [("zero2", "zero1"), ("fsdp", "zero2")], ids=["zero2-zero1", "fsdp-zero2"])
def test_a_resharded_checkpoint_of_a_model_with_other_layer_sizes_is_refused_on_every_rank(world, tmp_path, written,
                                                                                         resumed, hidden):
    """The same parameter names, each block's hidden layer smaller (its flat reads ran past one
    tensor into the next: scrambled weights, silently) or larger (an IndexError): resharded under
    another strategy, every rank refuses it naming a tensor, the saved shape and dtype and this
    model's, and what to do, before any rank loads anything (the model keeps its own weights)."""
    base = shared_directory(world, tmp_path, f"other_sizes.{written}.{resumed}.{hidden}")
    fit(world, written, f"{base}/ckpt", max_steps=2)
    model = WithExtras(seed=5, hidden=hidden)
    before = {name: value.detach().clone() for name, value in model.state_dict().items()}
    try:
        trainer(world, resumed, f"{base}/ckpt", max_steps=4, model=model)
        outcome = "no error"
    except sharded.CheckpointError as error:
        outcome = str(error)
    kept = all(torch.equal(value, before[name]) for name, value in model.state_dict().items())
    outcomes = collectives.allgather_object([outcome, kept], name=f"sharded.test.other_sizes.{written}.{hidden}")

    messages = [message for message, _ in outcomes]
    assert len(set(messages)) == 1, f"the ranks did not agree: {messages}"
    for rank in range(world.size):
        assert f"rank {rank}: blocks." in messages[0] and "float64 of shape [" in messages[0], messages[0]
    assert f"this model's float64 of shape [{hidden}" in messages[0] or f", {hidden}]" in messages[0], messages[0]
    assert "it belongs to another model" in messages[0] and "fresh checkpoint_dir" in messages[0], messages[0]
    assert all(kept for _, kept in outcomes), "a rank loaded part of the refused checkpoint"

"""The loop's features do what one process with the global batch does, under every strategy:
gradient clipping by the global norm, a step function of the user's own over dict batches,
BatchNorm statistics over the global batch, fp16's skipped steps, and the exported model.

Bounds: float64 throughout. N workers and one process add the same numbers in another order (the
all-reduce, the reduce-scatter, a sharded norm summed across ranks), ~1e-16 relative per
operation; over a few steps that stays below 1e-13, so 1e-10 is far above rounding and far below
what a missing feature changes (clipping, a wrong statistic or a lost metric move values by 1e-3
or more, checked in each test so that it proves something).
"""
import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from hvdtrain.distributed import collectives, rng
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import agreed, flat_parameters, small_mlp, synthetic_classification
from tests.unit.test_batching import Sentences, pad

pytestmark = pytest.mark.mpi

STRATEGIES = ["ddp", "zero1", "zero2", "fsdp"]
BOUND = 1e-10  # see the module's docstring
BATCH, STEPS, SEED = 4, 4, 11


def global_batches(samples, world_size, steps=STEPS):
    """The samples one process takes at each step: the sampler's order, a global batch at a time."""
    sampler = ShardedSampler(samples, rank=0, world_size=1, seed=SEED)
    sampler.set_epoch(0)
    order, size = list(sampler), BATCH * world_size
    return [order[step * size:(step + 1) * size] for step in range(steps)]


def config(strategy, **overrides):
    return TrainConfig(**{"epochs": 1, "batch_size": BATCH, "strategy": strategy, "scale_lr": False,
                          "warmup_epochs": 0, "max_steps": STEPS, "seed": SEED, "log_every": 1000, **overrides})


# ---- gradient clipping -------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_clipping_by_the_global_norm_matches_one_process(world, strategy):
    data = synthetic_classification(samples=96)
    max_norm = 0.05
    model = small_mlp(seed=100 + world.rank)
    make = lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9)
    trainer = Trainer(model, make(model.parameters()), data, None, config(strategy, max_grad_norm=max_norm),
                      world=world)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    trainer.fit()
    trainer.strategy.whole_model()

    reference = small_mlp(seed=0)
    reference.load_state_dict(initial)
    optimizer = make(reference.parameters())
    unclipped, norms = copy.deepcopy(reference), []
    unclipped_optimizer = make(unclipped.parameters())
    inputs, labels = data.tensors
    for batch in global_batches(len(data), world.size):
        for net, opt, clip in ((reference, optimizer, True), (unclipped, unclipped_optimizer, False)):
            opt.zero_grad()
            F.cross_entropy(net(inputs[batch]), labels[batch]).backward()
            if clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)))
            opt.step()
    ours = flat_parameters(trainer.model)
    rows = agreed([(ours - flat_parameters(reference)).abs().max(), (ours - flat_parameters(unclipped)).abs().max(),
                   trainer.parts.loop.grad_norm], name=f"clip.{strategy}")

    assert min(norms) > 2 * max_norm, f"the gradient norms {norms} never needed clipping: the test proves nothing"
    assert (rows[:, 0] < BOUND).all(), f"max |clipped run - one process clipping| per rank: {rows[:, 0].tolist()}"
    assert (rows[:, 1] > 1e-3).all(), "clipping changed nothing"
    # The last step's norm before clipping, the same on every rank, is the one process's.
    assert (rows[:, 2] - norms[-1]).abs().max() < BOUND * norms[-1]


# ---- a step of the user's own, over dict batches (a regression) ---------------------------------

class DictRegression(Dataset):
    """Hugging Face style samples: {"features": x, "target": y} with a real-valued target."""

    def __init__(self, samples: int) -> None:
        generator = torch.Generator().manual_seed(7)
        self.x = torch.randn(samples, 6, generator=generator, dtype=torch.float64)
        self.y = self.x @ torch.randn(6, generator=generator, dtype=torch.float64) + 0.1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return {"features": self.x[index], "target": self.y[index]}


def regression_step(model, batch):
    prediction = model(batch["features"]).squeeze(-1)
    error = prediction - batch["target"]
    return error.square().mean(), {"mae": error.abs().mean()}


def regressor(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_users_step_over_dict_batches_trains_and_reports_its_metrics(world, strategy):
    train, val = DictRegression(96), DictRegression(37)  # 37: uneven validation shards
    model = regressor(seed=200 + world.rank)
    make = lambda params: torch.optim.Adam(params, lr=0.01)
    trainer = Trainer(model, make(model.parameters()), train, val, config(strategy), world=world,
                      step_fn=regression_step)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    history = trainer.fit()
    trainer.strategy.whole_model()

    reference = regressor(seed=0)
    reference.load_state_dict(initial)
    optimizer = make(reference.parameters())
    for batch in global_batches(len(train), world.size):
        optimizer.zero_grad()
        regression_step(reference, train[batch])[0].backward()
        optimizer.step()
    with torch.no_grad():
        val_loss, val_metrics = regression_step(reference, val[list(range(len(val)))])
    record = history[-1]
    rows = agreed([(flat_parameters(trainer.model) - flat_parameters(reference)).abs().max(),
                   record["val_loss"] - float(val_loss), record["val_mae"] - float(val_metrics["mae"]),
                   record["val_samples"]], name=f"step_fn.{strategy}")

    assert set(record) >= {"train_loss", "train_mae", "val_loss", "val_mae"}
    assert "val_accuracy" not in record and "train_accuracy" not in record, "accuracy means nothing here"
    assert (rows[:, 0] < BOUND).all(), f"parameters differ from one process: {rows[:, 0].tolist()}"
    assert (rows[:, 1:3].abs() < BOUND).all(), f"validation loss and mae differ: {rows[:, 1:3].tolist()}"
    assert (rows[:, 3] == len(val)).all()


# ---- SyncBatchNorm through the Trainer ----------------------------------------------------------

def bn_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4)).double()


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_sync_batchnorm_matches_one_process_where_plain_batchnorm_does_not(world, strategy):
    data = synthetic_classification(samples=96)
    make = lambda params: torch.optim.SGD(params, lr=0.1)
    results = {}
    for sync in (True, False):
        model = bn_model(seed=300 + world.rank)
        trainer = Trainer(model, make(model.parameters()), data, None, config(strategy, sync_batchnorm=sync),
                          world=world)
        initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
        trainer.fit()
        trainer.strategy.whole_model()
        results[sync] = torch.cat([t.detach().double().reshape(-1) for t in trainer.model.state_dict().values()])
    reference = bn_model(seed=0)
    reference.load_state_dict(initial)
    optimizer = make(reference.parameters())
    inputs, labels = data.tensors
    for batch in global_batches(len(data), world.size):
        optimizer.zero_grad()
        F.cross_entropy(reference(inputs[batch]), labels[batch]).backward()
        optimizer.step()
    expected = torch.cat([t.detach().double().reshape(-1) for t in reference.state_dict().values()])
    rows = agreed([(results[True] - expected).abs().max(), (results[False] - expected).abs().max()],
                  name=f"syncbn.{strategy}")

    # Parameters, running mean and variance and the batch counter, all of them.
    assert (rows[:, 0] < BOUND).all(), f"sync BatchNorm differs from one process: {rows[:, 0].tolist()}"
    if world.size > 1:
        assert (rows[:, 1] > 1e-3).all(), "plain BatchNorm matched too: the test proves nothing"


# ---- fp16: a step with inf/nan on one rank's slice is skipped on every rank ---------------------

@pytest.mark.parametrize("strategy", STRATEGIES)
def test_fp16_skips_a_step_with_inf_on_every_rank_alike(world, strategy):
    data = synthetic_classification(samples=96, dtype=torch.float32)
    model = small_mlp(seed=400 + world.rank, dtype=torch.float32)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None,
                      config(strategy, precision="fp16"), world=world)
    poisoned_step = 2
    first_weight = next(trainer.model.parameters())

    def poison(grad):
        # One element on the last rank only: under a sharded strategy it lands in one rank's
        # slice, so the other ranks' own gradients are finite and only a common decision keeps
        # them from stepping.
        if trainer.global_step == poisoned_step and world.rank == world.size - 1:
            grad = grad.clone()
            grad.view(-1)[0] = float("inf")
        return grad

    first_weight.register_hook(poison)
    # What this rank holds of the parameters (its shards under zero and fsdp: fsdp's full
    # parameters hold no memory between steps).
    held = lambda: torch.cat([b.shard.detach().reshape(-1) for b in trainer.strategy.buckets]) \
        if hasattr(trainer.strategy, "buckets") else flat_parameters(trainer.model)
    seen = {}
    original_update = trainer.parts.loop.update

    def watched_update():
        before = held().clone()
        original_update()
        if trainer.global_step == poisoned_step:
            seen["unchanged"] = torch.equal(before, held())

    trainer.parts.loop.update = watched_update
    trainer.fit()
    trainer.strategy.whole_model()
    ours = flat_parameters(trainer.model)
    precision = trainer.parts.precision
    rows = agreed([precision.skipped_steps, precision.scale, float(seen.get("unchanged", False))],
                  name=f"fp16.{strategy}")
    replicas = collectives.allgather_rows(ours.double().reshape(1, -1), name=f"fp16.{strategy}.params")

    assert (rows[:, 0] == 1).all(), f"skipped steps per rank: {rows[:, 0].tolist()}"
    assert (rows[:, 1] == 2.0 ** 15).all(), f"the loss scale backs off once, on every rank: {rows[:, 1].tolist()}"
    assert (rows[:, 2] == 1).all(), "the skipped step moved the parameters"
    assert all(torch.equal(replicas[0], row) for row in replicas), "ranks hold different parameters"
    assert torch.isfinite(ours).all()


# ---- the exported model -------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_run_exports_the_trained_model_as_safetensors(world, strategy, shared_tmp_path):
    from safetensors.torch import load_file

    data = synthetic_classification(samples=96)
    model = small_mlp(seed=500 + world.rank)
    cfg = config(strategy, run_dir=str(shared_tmp_path), run_name=f"export-{strategy}", tensorboard=False)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, data, cfg, world=world)
    trainer.run()  # under fsdp written a unit at a time: the model stays sharded
    exported = shared_tmp_path / f"export-{strategy}" / "model.safetensors"
    trained = small_mlp(seed=2)
    trained.load_state_dict(trainer.strategy.exported_model_state())  # whole on every rank (a collective)
    collectives.barrier()
    loaded = small_mlp(seed=1)
    loaded.load_state_dict(load_file(str(exported)))
    difference = (flat_parameters(loaded) - flat_parameters(trained)).abs().max()
    rows = agreed([difference], name=f"export.{strategy}")

    assert (rows[:, 0] == 0).all(), "the exported weights are not the trained model's"
    assert (shared_tmp_path / f"export-{strategy}" / "config.yaml").exists()


@pytest.mark.parametrize("strategy,checkpoint_format", [("ddp", "full"), ("zero2", "sharded")])
def test_fp16_loss_scale_resumes_from_a_checkpoint(world, strategy, checkpoint_format, shared_tmp_path):
    data = synthetic_classification(samples=96, dtype=torch.float32)
    directory = shared_tmp_path / f"fp16-{strategy}-{checkpoint_format}"
    cfg = config(strategy, precision="fp16", checkpoint_dir=str(directory), checkpoint_format=checkpoint_format)
    model = small_mlp(seed=600, dtype=torch.float32)
    first = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None, cfg, world=world)
    first.parts.precision.scale, first.parts.precision.good_steps = 512.0, 3  # as if it had backed off and counted
    first.fit()  # ends with a checkpoint (the end of max_steps' epoch record)
    saved = first.parts.precision.state_dict()
    model = small_mlp(seed=601, dtype=torch.float32)
    resumed = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None, cfg, world=world)
    rows = agreed([resumed.global_step, resumed.parts.precision.scale, resumed.parts.precision.good_steps],
                  name=f"fp16.resume.{strategy}")

    assert (rows[:, 0] == STEPS).all(), "the second run did not resume from the first's checkpoint"
    assert (rows[:, 1] == saved["scale"]).all() and (rows[:, 2] == saved["good_steps"]).all(), rows.tolist()
    assert saved["scale"] == 512.0 and saved["good_steps"] == 3 + STEPS


# ---- the learning-rate schedule ----------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_cosine_schedule_steps_as_one_process_stepping_at_those_rates(world, strategy):
    """train.lr_schedule=cosine drives the optimizer the strategy steps (zero's is over its shards):
    over the run's 4 steps (max_steps), rate 0.5 x (1 + cos(pi s / 4)) / 2 at step s."""
    data = synthetic_classification(samples=96)
    model = small_mlp(seed=100 + world.rank)
    make = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    trainer = Trainer(model, make(model.parameters(), 0.5), data, None, config(strategy, lr_schedule="cosine"),
                      world=world)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    trainer.fit()
    trainer.strategy.whole_model()

    runs = {name: one_process_at(rates, initial, data, make, world.size) for name, rates in (
        ("cosine", [0.5 * 0.5 * (1 + math.cos(math.pi * s / STEPS)) for s in range(STEPS)]),
        ("constant", [0.5] * STEPS))}
    ours = flat_parameters(trainer.model)
    rows = agreed([(ours - runs["cosine"]).abs().max(), (ours - runs["constant"]).abs().max(),
                   trainer.optimizer.param_groups[0]["lr"]], name=f"schedule.{strategy}")
    assert (rows[:, 0] < BOUND).all(), f"max |trainer - one process at the cosine rates| per rank: {rows[:, 0].tolist()}"
    assert (rows[:, 1] > 1e-3).all(), "the schedule changed nothing: the test would not see it missing"
    assert (rows[:, 2] == 0.0).all(), f"the rate after the last step must be min_lr_ratio x peak = 0: {rows[:, 2]}"


def one_process_at(rates, initial, data, make, world_size):
    """One process taking the global batches at ``rates``, one per step: its final parameters."""
    reference = small_mlp(seed=0)
    reference.load_state_dict(initial)
    optimizer = make(reference.parameters(), rates[0])
    inputs, labels = data.tensors
    for rate, batch in zip(rates, global_batches(len(data), world_size)):
        for group in optimizer.param_groups:
            group["lr"] = rate
        optimizer.zero_grad()
        F.cross_entropy(reference(inputs[batch]), labels[batch]).backward()
        optimizer.step()
    return flat_parameters(reference)


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "fsdp"])
def test_the_first_step_already_runs_at_the_scaled_rate(world, strategy):
    """scale_lr without warm-up: every step, the first one included, at 0.5 x workers. (Under the
    sharded strategies the broadcast of rank 0's optimizer state used to bring back the unscaled
    rate after the scaling, for the first step only.)"""
    data = synthetic_classification(samples=96)
    make = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    model = small_mlp(seed=0)
    trainer = Trainer(model, make(model.parameters(), 0.5), data, None, config(strategy, scale_lr=True), world=world)
    trainer.fit()
    trainer.strategy.whole_model()
    expected = one_process_at([0.5 * world.size] * STEPS, small_mlp(seed=0).state_dict(), data, make, world.size)
    rows = agreed([(flat_parameters(model) - expected).abs().max()], name=f"first.rate.{strategy}")
    assert (rows < BOUND).all(), f"max |trainer - one process at the scaled rate| per rank: {rows.flatten().tolist()}"


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_a_scheduler_of_your_own_runs_over_the_scaled_rates_and_resumes_exactly(world, strategy, tmp_path):
    """lr_scheduler=ExponentialLR(gamma=0.5) over the optimizer the strategy steps, built after the
    rates were scaled to the global batch (x workers): rate 0.5 x N x 0.5^s at step s; stopped after 2
    steps and resumed from the checkpoint, the run ends bitwise where the uninterrupted one does."""
    base = collectives.allgather_object(str(tmp_path), name=f"own.scheduler.dir.{strategy}")[0]
    data = synthetic_classification(samples=96)
    make = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    halving = lambda optimizer: torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=0.5)  # noqa: E731

    def run(max_steps, directory=None):
        model = small_mlp(seed=0)
        trainer = Trainer(model, make(model.parameters(), 0.5), data, None,
                          config(strategy, scale_lr=True, max_steps=max_steps, checkpoint_dir=directory), world=world,
                          lr_scheduler=halving)
        trainer.fit()
        trainer.close()
        return trainer

    whole = run(STEPS)
    initial = small_mlp(seed=0).state_dict()
    run(2, f"{base}/resume")
    resumed = run(STEPS, f"{base}/resume")
    expected = one_process_at([0.5 * world.size * 0.5 ** s for s in range(STEPS)], initial, data, make, world.size)
    rows = agreed([(flat_parameters(whole.model) - expected).abs().max(),
                   (flat_parameters(resumed.model) - flat_parameters(whole.model)).abs().max(),
                   resumed.optimizer.param_groups[0]["lr"]], name=f"own.scheduler.{strategy}")

    assert (rows[:, 0] < BOUND).all(), f"max |trainer - one process at the scheduler's rates|: {rows[:, 0].tolist()}"
    assert (rows[:, 1] == 0).all(), f"max |resumed - uninterrupted|: {rows[:, 1].tolist()}"
    assert (rows[:, 2] == 0.5 * world.size * 0.5 ** STEPS).all(), rows[:, 2].tolist()
    assert "then your ExponentialLR" in whole.parts.lr.describe()
    with pytest.raises(ValueError, match="lr_scheduler replaces hvdtrain's own schedule: set train.warmup_epochs=0"):
        Trainer(small_mlp(seed=0), make(small_mlp(seed=0).parameters(), 0.5), data, None,
                config(strategy, warmup_epochs=1.0), world=world, lr_scheduler=halving)


# ---- evaluation between steps ------------------------------------------------------------------

class DrawsWhenEvaluating(nn.Module):
    """Identity, but it draws a random number in eval mode (as test-time augmentation or Monte-Carlo
    sampling in a user's model would): an evaluation must not move training's random stream."""

    def forward(self, x):
        if not self.training:
            torch.rand(1)
        return x


def with_dropout(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), DrawsWhenEvaluating(), nn.Dropout(0.3),
                         nn.Linear(16, 4)).to(torch.float64)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_evaluation_between_steps_measures_the_model_there_and_changes_nothing_of_training(world, tmp_path,
                                                                                              strategy):
    """eval_every=2 over 4 steps: the step-2 record is the evaluation of a run stopped at step 2, and
    the run ends bitwise where a run without it ends (dropout on again, its random stream untouched)."""
    base = collectives.allgather_object(str(tmp_path), name=f"eval.dir.{strategy}")[0]
    data, held_out = synthetic_classification(samples=96), synthetic_classification(samples=40)
    runs = {}
    for name, steps, extra in (("between", STEPS, {"eval_every": 2, "run_dir": base, "run_name": "between"}),
                               ("plain", STEPS, {}), ("stopped", 2, {})):
        rng.seed_everything(rng.rank_seed(SEED, world.rank))
        model = with_dropout(seed=7)
        trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.5), data, held_out,
                          config(strategy, **{**extra, "max_steps": steps}), world=world)
        history = trainer.fit()
        trainer.close()
        trainer.strategy.whole_model()
        runs[name] = (flat_parameters(trainer.model), history[-1])
    records = [json.loads(line) for line in (Path(base) / "between" / "metrics.jsonl").read_text().splitlines()]
    evaluations = [r for r in records if r["kind"] == "evaluation"]
    rows = agreed([(runs["between"][0] - runs["plain"][0]).abs().max()], name=f"eval.{strategy}")

    assert [r["step"] for r in evaluations] == [2], "one evaluation between steps; step 4 is the epoch record's"
    assert evaluations[0]["val_loss"] == runs["stopped"][1]["val_loss"], (evaluations[0], runs["stopped"][1])
    assert evaluations[0]["val_accuracy"] == runs["stopped"][1]["val_accuracy"]
    assert (rows == 0).all(), f"the evaluation changed training: max |with - without| per rank {rows.tolist()}"


# ---- the user's collate_fn (dynamic padding) ---------------------------------------------------

def test_the_trainer_batches_with_the_user_s_collate_fn(world):
    """Sequences of 1 to 7 tokens, padded per batch by the user's collate (torch's default cannot
    stack them): the Trainer's loaders use it for training and evaluation, and every step and
    evaluation sees batches padded to their own longest sample."""
    widths = []
    embedding = nn.EmbeddingBag(64, 4, mode="mean").to(torch.float64)

    def step(model, batch):
        widths.append(batch["tokens"].shape[1])
        logits = model(batch["tokens"])
        return F.cross_entropy(logits, batch["labels"] % 4), {}
    torch.manual_seed(0)
    trainer = Trainer(embedding, torch.optim.SGD(embedding.parameters(), lr=0.1), Sentences(), Sentences(),
                      config("ddp", eval_batch_size=16), world=world, step_fn=step, collate_fn=pad)
    history = trainer.fit()
    rows = agreed([trainer.global_step, history[-1]["val_loss"], min(widths), max(widths)], name="collate")
    assert (rows[:, 0] == STEPS).all() and torch.isfinite(rows[:, 1]).all(), rows.tolist()
    assert (rows[:, 2] < rows[:, 3]).all(), f"every batch padded to one width: {rows.tolist()}"

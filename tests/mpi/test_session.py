"""Your own loop on hvdtrain.setup: the same run as the Trainer's, bitwise, under every kind of
strategy; your own state kept in the checkpoints and resumed exactly; what it cannot do refused."""
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import hvdtrain
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives, rng
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi

# Accumulation, clipping, a warm-up and a cosine decay, dropout-free: every part of a step the own
# loop must reproduce; 40 steps cross three epochs (192 samples, global batch 2 x 2 x 2 = 8 at 2 ranks).
SETTINGS = dict(epochs=3, batch_size=2, accumulation=2, max_grad_norm=0.5, warmup_epochs=0.5,
                lr_schedule="cosine", seed=5, log_every=1000)


def owned(session):
    """This rank's parameters as the strategy holds them (its shards under zero/fsdp), float64."""
    return torch.cat([p.detach().reshape(-1) for p in session.strategy.owned_parameters()])


def own_loop(hv, counters=None):
    """The shape of Horovod's pytorch_mnist.py train(): epochs, batches, forward, backward, step."""
    for _ in hv.epochs():
        for inputs, targets in hv.batches():
            with hv.autocast():
                loss = F.cross_entropy(hv.model(inputs), targets)
            hv.backward(loss)
            if hv.step() and counters is not None:
                counters["steps"] += 1


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_own_loop_equals_the_trainer_bitwise(world, strategy):
    config = TrainConfig(strategy=strategy, **SETTINGS)
    data = synthetic_classification(samples=192)

    model = small_mlp(3)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world)
    rng.seed_everything(rng.rank_seed(1, world.rank))
    history = trainer.fit()

    model = small_mlp(3)
    hv = hvdtrain.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, config, world=world)
    rng.seed_everything(rng.rank_seed(1, world.rank))
    own_loop(hv)

    difference = collectives.allgather_object(torch.count_nonzero(owned(hv) - owned(trainer)).item(),
                                              name="session.equal")
    assert trainer.global_step == hv.global_step == 3 * (192 // (2 * 2 * world.size))
    assert difference == [0] * world.size, f"elements differing per rank: {difference}"
    # The same epoch records (train loss means, the LR), reported by the same code.
    assert [r["train_loss"] for r in hv.history] == [r["train_loss"] for r in history]
    assert [r["lr"] for r in hv.history] == [r["lr"] for r in history]


class Countdown(torch.optim.lr_scheduler.StepLR):
    """A scheduler the user steps: its state must survive a resume."""


def run_own(world, directory, max_steps, strategy, checkpoint_format):
    model = small_mlp(4)
    config = TrainConfig(strategy=strategy, checkpoint_dir=directory, checkpoint_every=5, max_steps=max_steps,
                         checkpoint_format=checkpoint_format,
                         **{**SETTINGS, "lr_schedule": "constant", "warmup_epochs": 0})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    hv = hvdtrain.setup(model, optimizer, synthetic_classification(), config, world=world)
    # The strategy steps an optimizer of its own (Horovod's wrapper; one over this rank's shards): a
    # scheduler over the one built would change rates nothing reads.
    with pytest.raises(ValueError, match="build the scheduler over hv.optimizer"):
        hv.keep(schedule=torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5))
    schedule = torch.optim.lr_scheduler.StepLR(hv.optimizer, step_size=3, gamma=0.5)
    counters = {"steps": 0}
    hv.keep(schedule=schedule, counters=counters)
    for _ in hv.epochs():
        for inputs, targets in hv.batches():
            hv.backward(F.cross_entropy(hv.model(inputs), targets))
            if hv.step():
                schedule.step()
                counters["steps"] += 1
    hv.close()
    return hv, schedule, counters


@pytest.mark.parametrize("strategy,checkpoint_format", [
    ("ddp", "full"), ("zero1", "full"), ("zero1", "sharded"), ("zero2", "full"), ("zero2", "sharded"),
    ("fsdp", "full"), ("fsdp", "sharded")])
def test_kept_state_resumes_exactly(world, tmp_path, strategy, checkpoint_format):
    base = collectives.allgather_object(str(tmp_path), name="session.dir")[0]
    whole, whole_schedule, whole_counters = run_own(world, f"{base}/whole", 12, strategy, checkpoint_format)
    run_own(world, f"{base}/stopped", 7, strategy, checkpoint_format)  # its last checkpoint: step 7 (max_steps saves)
    resumed, schedule, counters = run_own(world, f"{base}/stopped", 12, strategy, checkpoint_format)

    assert counters == whole_counters == {"steps": 12}, "the counter went on from the checkpoint's 7"
    assert schedule.state_dict() == whole_schedule.state_dict()
    # hvdtrain's constant schedule leaves the rate to the user's, after scaling it to the global batch.
    scaled = 0.1 * (2 * 2 * world.size) / 2  # x the global batch (2 x 2 x workers) / batch_size
    assert resumed.optimizer.param_groups[0]["lr"] == whole.optimizer.param_groups[0]["lr"] == scaled * 0.5 ** 4
    difference = collectives.allgather_object(torch.count_nonzero(owned(resumed) - owned(whole)).item(),
                                              name="session.resumed")
    assert difference == [0] * world.size


def test_what_the_own_loop_cannot_do_is_refused(world, tmp_path):
    model = small_mlp(1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = synthetic_classification(samples=64)
    with pytest.raises(ValueError, match="use hvdtrain.Trainer"):
        hvdtrain.setup(model, optimizer, data, TrainConfig(pipeline_parallel=2), world=world)

    hv = hvdtrain.setup(model, optimizer, data, TrainConfig(epochs=1, batch_size=4, log_every=1000, warmup_epochs=1),
                        world=world)
    with pytest.raises(RuntimeError, match="inside an epoch"):
        hv.batches()
    with pytest.raises(ValueError, match="train.checkpoint_dir"):
        hv.save()
    with pytest.raises(TypeError, match="state_dict"):
        hv.keep(steps=3)
    # A one-epoch warm-up sets the rate at every step: a scheduler of your own would be
    # overwritten, silently. Refused, saying how to step it yourself or have hvdtrain step it.
    with pytest.raises(ValueError, match=r"train.warmup_epochs=0, train.warmup_steps=null and train.lr_schedule="
                                         r"constant .* or give it to setup as lr_scheduler="):
        hv.keep(schedule=torch.optim.lr_scheduler.StepLR(hv.optimizer, step_size=3))
    with pytest.raises(ValueError, match=r"set train.warmup_epochs=0, train.warmup_steps=null \(or 0\) and "
                                         r"train.lr_schedule=constant \(got 0, 5 and constant\)"):
        hvdtrain.setup(model, optimizer, data, TrainConfig(warmup_epochs=0, warmup_steps=5), world=world,
                       lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, step_size=3))
    # Every rank leaves its batches early alike here: the error says how to end early instead.
    with pytest.raises(RuntimeError, match="request_stop"):
        for _ in hv.epochs():
            for inputs, targets in hv.batches():
                hv.backward(F.cross_entropy(hv.model(inputs), targets))
                hv.step()
                break


@pytest.mark.process_sets
def test_own_loop_equals_the_trainer_bitwise_under_tensor_parallelism(world):
    """T=2 (the example transformer, hvdtrain's own plan): the own loop's backward and step drive the
    split layers' collectives as the Trainer's do."""
    from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
    from hvdtrain.examples.textlm_parallel import tensor_plan
    from hvdtrain.parallel.model_plan import ModelPlan
    from torch.utils.data import TensorDataset
    if world.size % 2:
        pytest.skip("T=2 needs an even world")
    ids = torch.randint(0, 11, (64, 9), generator=torch.Generator().manual_seed(3))
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    config = TrainConfig(tensor_parallel=2, max_steps=6, **{**SETTINGS, "epochs": 1, "batch_size": 4})

    def build():
        torch.manual_seed(0)
        model = TinyTransformerLM(11, seq_len=8, d_model=16, layers=2, heads=4).double()
        return model, torch.optim.AdamW(model.parameters(), lr=0.01), ModelPlan(tensor_plan=tensor_plan(model))

    model, optimizer, plan = build()
    trainer = Trainer(model, optimizer, data, None, config, world=world, loss_fn=lm_loss, model_plan=plan)
    rng.seed_everything(rng.rank_seed(1, world.rank))
    trainer.fit()
    trained = owned(trainer)
    trainer.close_mesh()

    model, optimizer, plan = build()
    hv = hvdtrain.setup(model, optimizer, data, config, world=world, model_plan=plan)
    rng.seed_everything(rng.rank_seed(1, world.rank))
    for _ in hv.epochs():
        for inputs, targets in hv.batches():
            hv.backward(lm_loss(hv.model(inputs), targets))
            hv.step()
    difference = collectives.allgather_object(torch.count_nonzero(owned(hv) - trained).item(), name="session.tp")
    steps = hv.global_step
    hv.close_mesh()
    assert steps == 6
    assert difference == [0] * world.size, f"elements differing per rank: {difference}"


def test_a_preemption_ends_the_own_loop_on_every_rank_with_a_checkpoint(world, tmp_path):
    import os
    import signal
    base = collectives.allgather_object(str(tmp_path), name="session.preempt.dir")[0]
    model = small_mlp(2)
    config = TrainConfig(checkpoint_dir=f"{base}/ckpt", preempt_check_every=1, **SETTINGS)
    hv = hvdtrain.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), synthetic_classification(), config,
                        world=world)
    for _ in hv.epochs():
        for inputs, targets in hv.batches():
            hv.backward(F.cross_entropy(hv.model(inputs), targets))
            if hv.step() and hv.global_step == 3 and world.is_root:
                os.kill(os.getpid(), signal.SIGUSR1)  # as SLURM's --signal would: rank 0 alone gets it
    hv.close()
    # The next step's vote carries rank 0's signal to every rank: all stop after step 4, checkpointed.
    ended = collectives.allgather_object((hv.preempted, hv.global_step), name="session.preempt.ended")
    assert ended == [(True, 4)] * world.size
    if world.is_root:
        assert (Path(base) / "ckpt" / "ckpt-000000004.pt").exists()


def test_your_own_loader_factory_trains_what_hvdtrain_s_loaders_train(world):
    """A DataLoader of your own over hvdtrain's sampler (2 worker processes, persistent): the same
    batches, so the same weights, bitwise."""
    from torch.utils.data import DataLoader

    def own(dataset, sampler, batch_size):
        return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=2, persistent_workers=True)

    runs = []
    for factory in (None, own):
        model = small_mlp(6)
        hv = hvdtrain.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), synthetic_classification(),
                            TrainConfig(**{**SETTINGS, "epochs": 2}), world=world, loader_factory=factory)
        rng.seed_everything(rng.rank_seed(1, world.rank))
        own_loop(hv)
        runs.append(owned(hv))
    difference = collectives.allgather_object(torch.count_nonzero(runs[0] - runs[1]).item(), name="session.factory")
    assert difference == [0] * world.size


def test_the_loaders_worker_processes_end_with_training(world):
    """Loader workers persist between epochs, and end when fit() or the own loop ends. Before, they
    lived on until the garbage collector freed the run, which shut them down after their own
    queues: each worker then waited out torch's 5 s status interval (10 s at every run's end)."""
    import psutil

    def live_children():
        return {child.pid for child in psutil.Process().children() if child.status() != psutil.STATUS_ZOMBIE}

    before = live_children()  # what earlier tests may have left (under Gloo, one process per rank)
    model = small_mlp(6)
    config = TrainConfig(**{**SETTINGS, "epochs": 1, "num_workers": 2})
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), synthetic_classification(),
                      synthetic_classification(samples=32), config, world=world)
    trainer.fit()  # trains and evaluates: both loaders' workers ran
    after_fit = len(live_children() - before)
    model = small_mlp(6)
    hv = hvdtrain.setup(model, torch.optim.SGD(model.parameters(), lr=0.1), synthetic_classification(), config,
                        world=world)
    own_loop(hv)
    left = collectives.allgather_object((after_fit, len(live_children() - before)), name="session.loader_workers")

    assert left == [(0, 0)] * world.size, f"worker processes left after training, per rank: {left}"

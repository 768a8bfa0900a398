import pytest
import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed.world import World
from hvdtrain.components.lr import LearningRate, decay_factor, lr_scale, warmup_factor

FOUR_WORKERS = World(rank=0, size=4, local_rank=0, local_size=4, cross_rank=0, cross_size=1, hostname="node1",
                     controller="mpi", launcher="test", threads=1, device=torch.device("cpu"))


def test_scale_is_global_batch_over_one_worker_batch_or_one_when_disabled():
    assert lr_scale(global_batch=32 * 8 * 2, base_batch=32, enabled=True) == 16.0  # 8 workers x 2 micro
    assert lr_scale(global_batch=512, base_batch=32, enabled=False) == 1.0
    # Resumed on 4 workers with the global batch of 8 x 32: the per-worker batch grows, the LR stays.
    assert lr_scale(global_batch=256, base_batch=32, enabled=True) == 8.0


def test_warmup_rises_linearly_from_the_single_worker_rate_to_the_scaled_rate():
    factor = warmup_factor(scale=4.0, warmup_steps=10)
    assert factor(0) == pytest.approx(0.25)   # 4x scaled LR x 0.25 = the one-worker LR
    assert factor(5) == pytest.approx(0.625)
    assert factor(10) == pytest.approx(1.0)
    assert factor(1000) == pytest.approx(1.0)


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_a_rate_not_scaled_warms_up_from_its_peak_over_the_warmup_steps(scale):
    """One worker or scale_lr=false (or below 1: Adasum resumed on more workers): there is no
    one-worker rate below the peak to start from, so the warm-up starts at peak / steps; it used to
    do nothing at all, while the start line announced it."""
    factor = warmup_factor(scale, warmup_steps=10)
    assert [factor(step) for step in (0, 5, 10, 1000)] == pytest.approx([0.1, 0.55, 1.0, 1.0])
    rates = [factor(step) for step in range(11)]
    assert all(a < b for a, b in zip(rates, rates[1:])), "it rises at every warm-up step"


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_no_warmup_when_no_steps_are_asked(scale):
    assert warmup_factor(scale, 0)(0) == 1.0


def test_a_non_positive_scale_is_refused():
    with pytest.raises(ValueError, match="LR scale must be positive"):
        warmup_factor(0.0, 10)


def test_each_schedule_holds_then_decays_to_the_minimum_at_the_last_step():
    """100 steps, 10 of warm-up, ending at 10% of the peak: the shapes by their defining points."""
    points = {name: decay_factor(name, warmup_steps=10, total_steps=100, min_ratio=0.1, decay_fraction=0.2)
              for name in ("constant", "linear", "cosine", "wsd")}
    assert [points["constant"](s) for s in (0, 10, 55, 100, 150)] == [1.0] * 5
    assert points["linear"](10) == 1.0 and points["linear"](55) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert points["cosine"](10) == 1.0 and points["cosine"](55) == pytest.approx(0.55)  # cos(pi/2) = 0
    assert points["cosine"](30) > points["linear"](30)  # cosine stays high first, then falls faster
    assert points["wsd"](80) == 1.0 and points["wsd"](90) == pytest.approx(0.55)  # the last 20 steps decay
    for name in ("linear", "cosine", "wsd"):
        assert points[name](100) == pytest.approx(0.1) and points[name](150) == pytest.approx(0.1)
        rates = [points[name](s) for s in range(10, 101)]
        assert all(a >= b for a, b in zip(rates, rates[1:])), f"{name} must never rise after the warm-up"


def test_the_optimizer_steps_at_the_warmed_up_decayed_rate_of_each_group():
    """Two groups at 0.1 and 0.01, scaled x4, 4 warm-up steps, cosine over 12 steps to 0."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.01}])
    config = TrainConfig(batch_size=8, lr=0.1, lr_schedule="cosine", min_lr_ratio=0.0)
    rate = LearningRate(config, optimizer)
    rate.start(global_batch=32, warmup_steps=4, world=FOUR_WORKERS, step=0, total_steps=12)
    seen = []
    for _ in range(12):
        seen.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        rate.step()
    seen.append([group["lr"] for group in optimizer.param_groups])
    assert seen[0] == pytest.approx([0.1, 0.01])  # one worker's rates
    assert seen[4] == pytest.approx([0.4, 0.04])  # the scaled peak
    assert seen[8] == pytest.approx([0.2, 0.02])  # halfway through the decay: cos(pi/2)
    assert seen[12] == pytest.approx([0.0, 0.0], abs=1e-15)
    assert rate.describe() == ("peak lr 0.4/0.04 (train.lr 0.1/0.01 x 4 for the global batch: train.scale_lr, false keeps "
                               "your rate) after 4 warm-up steps from 0.1/0.01 "
                               "(one worker's rate), cosine decay to x 0 at step 12")


@pytest.mark.parametrize("name,value", [("lr_schedule", "step"), ("min_lr_ratio", 1.5), ("min_lr_ratio", float("nan")),
                                        ("decay_fraction", 0.0)])
def test_a_bad_schedule_setting_is_refused(name, value):
    with pytest.raises(ValueError, match=rf"TrainConfig\.{name} must be"):
        TrainConfig(**{name: value})


def test_train_lr_replaces_the_optimizers_rates_keeping_each_groups_ratio():
    """A body at 2e-5 and a head at 10x, set to train.lr=1e-4: the head goes to 1e-3. The old Trainer
    ignored train.lr and stepped at the optimizer's 2e-5 while its start line printed train.lr."""
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW([{"params": [model.weight], "lr": 2e-5}, {"params": [model.bias], "lr": 2e-4}])
    rate = LearningRate(TrainConfig(batch_size=8, lr=1e-4, scale_lr=False, warmup_epochs=0), optimizer)
    rate.start(global_batch=32, warmup_steps=0, world=FOUR_WORKERS, step=0, total_steps=12)
    assert [group["lr"] for group in optimizer.param_groups] == pytest.approx([1e-4, 1e-3], rel=1e-12)
    assert rate.describe() == "peak lr 0.0001/0.001 (train.lr 0.0001/0.001 x 1), no warm-up"


def test_without_train_lr_the_optimizers_own_rates_are_scaled_and_printed_as_they_are_reached():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    rate = LearningRate(TrainConfig(batch_size=8, warmup_epochs=0), optimizer)
    rate.start(global_batch=32, warmup_steps=0, world=FOUR_WORKERS, step=0, total_steps=12)
    assert TrainConfig().lr is None
    assert optimizer.param_groups[0]["lr"] == pytest.approx(8e-5, rel=1e-12)  # scale_lr: 32 / 8 = 4 one-worker batches
    assert rate.describe() == ("peak lr 8e-05 (the optimizer's 2e-05 x 4 for the global batch: train.scale_lr, "
                               "false keeps your rate), no warm-up")


def test_one_worker_steps_at_the_warmed_up_rate_and_the_start_line_says_from_where():
    """scale_lr=false, 4 warm-up steps: the optimizer's rate at each step, 0.05 / 4 first."""
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.2)
    rate = LearningRate(TrainConfig(batch_size=8, scale_lr=False), optimizer)
    rate.start(global_batch=32, warmup_steps=4, world=FOUR_WORKERS, step=0, total_steps=12)
    seen = []
    for _ in range(6):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        rate.step()
    assert seen == pytest.approx([0.05, 0.0875, 0.125, 0.1625, 0.2, 0.2])
    assert rate.describe() == "peak lr 0.2 (the optimizer's 0.2 x 1) after 4 warm-up steps from 0.05 (peak / 4)"
    rate.start(global_batch=32, warmup_steps=40, world=FOUR_WORKERS, step=0, total_steps=12)
    assert rate.describe().endswith("(longer than the run's 12 steps: the peak is never reached)")


def test_train_lr_cannot_scale_an_optimizer_whose_first_group_has_no_rate():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD([{"params": [model.weight], "lr": 0.0}, {"params": [model.bias], "lr": 0.1}])
    with pytest.raises(ValueError, match=r"give that group a rate > 0, or leave train.lr unset"):
        LearningRate(TrainConfig(lr=0.05), optimizer)


def test_a_scheduler_factory_is_given_the_total_steps_only_when_it_requires_them():
    """lambda optimizer, total_steps: ... gets the run's steps; a scheduler class or a partial given
    as the factory keeps the one-argument call (the total would otherwise fill ConstantLR's factor or
    a partial's keyword, silently or with a TypeError)."""
    import functools

    from hvdtrain.components.lr import wants_total_steps

    schedulers = torch.optim.lr_scheduler
    assert wants_total_steps(lambda optimizer, total_steps: None)
    assert not wants_total_steps(lambda optimizer: None)
    assert not wants_total_steps(schedulers.ConstantLR)
    assert not wants_total_steps(functools.partial(schedulers.StepLR, step_size=3))
    assert not wants_total_steps(lambda optimizer, total_steps=10: None)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.2)
    seen = []
    rate = LearningRate(TrainConfig(batch_size=8, scale_lr=False), optimizer,
                        factory=lambda optimizer, total: seen.append(total) or schedulers.LinearLR(
                            optimizer, start_factor=1.0, end_factor=0.5, total_iters=total))
    rate.start(global_batch=8, warmup_steps=0, world=FOUR_WORKERS, step=0, total_steps=12)
    assert seen == [12] and rate.scheduler.total_iters == 12
    rate = LearningRate(TrainConfig(batch_size=8, scale_lr=False), optimizer, factory=schedulers.ConstantLR)
    rate.start(global_batch=8, warmup_steps=0, world=FOUR_WORKERS, step=0, total_steps=12)
    assert rate.scheduler.factor == pytest.approx(1 / 3)  # ConstantLR's own default, not the total

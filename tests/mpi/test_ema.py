"""The EMA callback under ddp, zero2, fsdp (and ps): each rank's averages (of the whole model, or of its
own slices) equal an EMA computed by hand in float64 from the whole weights after every step, the
trained weights come back after ``applied``, and a resumed run continues the averages bitwise."""
import pytest
import torch

from hvdtrain import EMA, Callback
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import small_mlp, synthetic_classification

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank averages the whole model under every strategy"),
    pytest.mark.np4(reason="the averages of each rank's own slices (zero2, fsdp) change with the world size"),
    pytest.mark.gloo_np4(reason="the same slices at 4 ranks over Gloo"),
]

DECAY = 0.75  # far from 1, so that 8 steps move the average well away from the weights and from the start


class WholeWeights(Callback):
    """The whole model's parameters after every step, as one process would hold them (a collective)."""

    def __init__(self):
        self.after_step = []

    def on_train_start(self, trainer):
        if not self.after_step:
            self.after_step.append(whole_parameters(trainer))

    def on_step_end(self, trainer, step):
        self.after_step.append(whole_parameters(trainer))


def whole_parameters(trainer):
    names = {name for name, _ in trainer.model.named_parameters()} or None
    return {name: tensor.clone() for name, tensor in trainer.strategy.full_tensors()
            if names is None or name in names or name.replace("module.", "") in names}


def train(world, strategy, callbacks, max_steps, directory=None, checkpoint_format="full"):
    model = small_mlp(seed=0)  # float64
    config = TrainConfig(epochs=2, batch_size=4, lr=0.05, warmup_epochs=0, seed=3, max_steps=max_steps,
                         strategy=strategy, log_every=1000, tensorboard=False, checkpoint_dir=directory,
                         checkpoint_every=4 if directory else 0, checkpoint_format=checkpoint_format)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9),
                      synthetic_classification(samples=96), None, config, world=world, callbacks=callbacks)
    trainer.fit()
    trainer.close()
    return trainer


@pytest.mark.parametrize("strategy", ["ddp", "zero2", "fsdp", "ps"])
def test_the_ema_equals_one_computed_by_hand_from_the_whole_weights(world, strategy):
    ema, weights = EMA(decay=DECAY), WholeWeights()
    trainer = train(world, strategy, [ema, weights], max_steps=8)
    with ema.applied(trainer):
        averaged = whole_parameters(trainer)
    trained = whole_parameters(trainer)

    expected = {name: tensor.clone() for name, tensor in weights.after_step[0].items()}
    for after in weights.after_step[1:]:
        for name, value in after.items():
            expected[name].mul_(DECAY).add_(value, alpha=1.0 - DECAY)
    # The same float64 operations element by element, whoever holds the element: equal to the last
    # bit. Checked on every rank, after every collective.
    differences = {name: (averaged[name] - expected[name]).abs().max().item() for name in expected}
    moved = {name: (averaged[name] - trained[name]).abs().max().item() for name in expected}
    restored = all(torch.equal(trained[name], weights.after_step[-1][name]) for name in expected)
    assert len(weights.after_step) == 9 and ema.updates == 8
    assert all(difference == 0.0 for difference in differences.values()), differences
    assert all(distance > 1e-4 for distance in moved.values()), f"the average is the weights: {moved}"
    assert restored, "applied() must give back the trained weights bitwise"


class OwnedWeights(Callback):
    """This rank's own parameters (what its EMA averages) after every step; local, no collective."""

    def __init__(self):
        self.after_step = []

    def on_step_end(self, trainer, step):
        self.after_step.append([tensor.detach().clone() for tensor in trainer.strategy.owned_parameters()])


@pytest.mark.parametrize("strategy,checkpoint_format", [("ddp", "full"), ("zero2", "full"), ("fsdp", "sharded")])
def test_a_resumed_run_continues_the_ema_bitwise(world, tmp_path, strategy, checkpoint_format):
    """Stopped at step 4 and resumed to 8: the resumed EMA is the stopped one's averages continued with
    the resumed run's weights, to the last bit (started anew from the step-4 weights, it is not).
    Compared with the resumed run's own weights, not with an uninterrupted run's: Horovod's Gloo
    all-reduce at 4 ranks may fuse tensors differently from run to run, which moves the weights'
    last bits; the EMA's resume is what is tested here (the weights' own: tests/mpi/test_resume.py)."""
    base = collectives.allgather_object(str(tmp_path), name=f"ema.dir.{strategy}")[0]
    stopped, resumed, weights = EMA(decay=DECAY), EMA(decay=DECAY), OwnedWeights()
    train(world, strategy, [stopped], max_steps=4, directory=f"{base}/run", checkpoint_format=checkpoint_format)
    train(world, strategy, [resumed, weights], max_steps=8, directory=f"{base}/run",
          checkpoint_format=checkpoint_format)

    expected = [average.clone() for average in stopped.averages]
    for owned in weights.after_step:
        for average, weight in zip(expected, owned):
            average.mul_(DECAY).add_(weight, alpha=1.0 - DECAY)
    same = len(weights.after_step) == 4 and all(torch.equal(a, b) for a, b in zip(resumed.averages, expected))
    every_rank = collectives.allgather_object(same, name=f"ema.resume.{strategy}")
    assert stopped.updates == 4 and resumed.updates == 8
    assert all(every_rank), f"ranks whose resumed EMA is not the stopped one's continued: {every_rank}"


def test_a_run_resumed_under_another_strategy_starts_its_ema_anew_from_the_loaded_weights(world, tmp_path):
    """zero2's averages are each rank's slices: under ddp they would not fit, so the EMA starts again."""
    base = collectives.allgather_object(str(tmp_path), name="ema.dir.switch")[0]
    train(world, "zero2", [EMA(decay=DECAY)], max_steps=4, directory=f"{base}/run")
    resumed, weights = EMA(decay=DECAY), WholeWeights()
    trainer = train(world, "ddp", [resumed, weights], max_steps=6, directory=f"{base}/run")

    expected = {name: tensor.clone() for name, tensor in weights.after_step[0].items()}  # the step-4 weights
    for after in weights.after_step[1:]:
        for name, value in after.items():
            expected[name].mul_(DECAY).add_(value, alpha=1.0 - DECAY)
    names = [name for name, _ in trainer.model.named_parameters()]
    same = all(torch.equal(average, expected[name]) for name, average in zip(names, resumed.averages))
    every_rank = collectives.allgather_object(same, name="ema.switch")
    assert resumed.updates == 2 and len(weights.after_step) == 3
    assert all(every_rank), every_rank


def test_bad_decay_is_refused_saying_what_to_pass():
    with pytest.raises(ValueError, match=r"must be a number in \[0, 1\)"):
        EMA(decay=1.0)

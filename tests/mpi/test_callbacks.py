"""Callbacks through the Trainer: every hook at its point with the same arguments on every rank, a
stop asked on one rank agreed by all (no hang), and EarlyStopping ending a run whose monitored
metric stops improving."""
import pytest
import torch

from hvdtrain import Callback, EarlyStopping
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import small_mlp, synthetic_classification

pytestmark = pytest.mark.mpi


class Recorder(Callback):
    def __init__(self):
        self.calls = []

    def on_train_start(self, trainer):
        self.calls.append(("train_start", trainer.global_step))

    def on_step_end(self, trainer, step):
        self.calls.append(("step", step))

    def on_log(self, trainer, step, metrics):
        self.calls.append(("log", step, sorted(metrics)))

    def on_evaluation_end(self, trainer, step, metrics):
        self.calls.append(("evaluation", step, round(metrics["val_loss"], 12)))

    def on_epoch_end(self, trainer, record):
        self.calls.append(("epoch", record["step"]))

    def on_checkpoint(self, trainer, step):
        self.calls.append(("checkpoint", step))

    def on_train_end(self, trainer, history):
        self.calls.append(("train_end", trainer.global_step, len(history)))


class StopOnOneRank(Callback):
    def on_step_end(self, trainer, step):
        if step == 3 and trainer.world.rank == trainer.world.size - 1:
            trainer.request_stop("asked by the last rank alone")


def fit(world, tmp_path, name, callbacks, **settings):
    base = collectives.allgather_object(str(tmp_path), name=f"callbacks.dir.{name}")[0]
    config = TrainConfig(**{**dict(epochs=1, batch_size=4, lr=0.05, warmup_epochs=0, seed=5, max_steps=20,
                                   log_every=2, eval_every=2, tensorboard=False,
                                   checkpoint_dir=f"{base}/{name}", checkpoint_every=3), **settings})
    model = small_mlp(seed=0)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr), synthetic_classification(samples=192),
                      synthetic_classification(samples=64), config, world=world, callbacks=callbacks)
    trainer.fit()
    trainer.close()
    return trainer


def test_every_hook_is_called_at_its_point_with_the_same_arguments_on_every_rank(world, tmp_path):
    recorder = Recorder()
    fit(world, tmp_path, "hooks", [recorder], max_steps=4)
    every_rank = collectives.allgather_object(recorder.calls, name="callbacks.hooks")

    metrics = ["accuracy", "loss"]
    evaluation_2, evaluation_4 = [call[2] for call in recorder.calls if call[0] == "evaluation"]
    assert recorder.calls == [
        ("train_start", 0), ("step", 1), ("step", 2), ("evaluation", 2, evaluation_2), ("log", 2, metrics),
        ("step", 3), ("checkpoint", 3), ("step", 4), ("log", 4, metrics),
        # max_steps ends the epoch early (eval_every leaves the last step to it): its record's
        # evaluation, the record, its checkpoint
        ("evaluation", 4, evaluation_4), ("epoch", 4), ("checkpoint", 4), ("train_end", 4, 1)]
    assert all(calls == every_rank[0] for calls in every_rank), "the ranks' callbacks saw different calls"


def test_a_stop_asked_on_one_rank_stops_every_rank_at_the_next_vote_with_a_checkpoint(world, tmp_path):
    trainer = fit(world, tmp_path, "stop", [StopOnOneRank()], preempt_check_every=5, eval_every=0, checkpoint_every=0)
    steps = collectives.allgather_object(trainer.global_step, name="callbacks.stop.steps")
    saved = sorted(p.name for p in (tmp_path.parent / tmp_path.name).glob("stop/ckpt-*.pt")) if world.is_root else None

    assert steps == [5] * world.size  # asked at step 3, agreed at the vote of step 5
    assert trainer.parts.loop.stopped
    if world.is_root:
        assert saved == ["ckpt-000000005.pt"], saved
        expected = "asked by the last rank alone" if world.size == 1 else "a callback on another rank asked to stop"
        assert trainer.parts.callbacks.stop_reason == expected


def test_early_stopping_ends_the_run_when_the_metric_stops_improving(world, tmp_path):
    """min_delta far above any change: the first evaluation (step 2) is the best, the next two do not
    improve on it, so patience 2 stops the run at step 6 of 20."""
    stopper = EarlyStopping(monitor="val_loss", patience=2, min_delta=1e9)
    trainer = fit(world, tmp_path, "early", [stopper])
    steps = collectives.allgather_object(trainer.global_step, name="callbacks.early.steps")

    assert steps == [6] * world.size
    # The stop ends the epoch at step 6, and the epoch's record evaluates once more (as at max_steps).
    assert (stopper.best_step, stopper.waited) == (2, 3)
    assert trainer.parts.callbacks.stop_reason.startswith("early stopping: val_loss has not improved")


def test_early_stopping_on_a_metric_the_evaluation_does_not_report_is_refused_on_every_rank(world, tmp_path):
    with pytest.raises(ValueError, match="EarlyStopping monitors 'val_f1', which the evaluation does not report: "
                                         "it reports val_accuracy, val_loss"):
        fit(world, tmp_path, "unknown", [EarlyStopping(monitor="val_f1")])

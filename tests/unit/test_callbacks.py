"""EarlyStopping's rule on its own: which evaluations count as improvements, when it asks to stop,
and the settings it refuses."""
import pytest

from hvdtrain import Callback, EarlyStopping
from hvdtrain.components.callbacks import Callbacks


class Asked:
    def __init__(self):
        self.reasons = []

    def request_stop(self, reason):
        self.reasons.append(reason)


def evaluate(stopper, values, metric="val_accuracy"):
    trainer = Asked()
    for step, value in enumerate(values, start=1):
        stopper.on_evaluation_end(trainer, step, {metric: value, "val_loss": 0.0})
    return trainer.reasons


def test_max_mode_counts_only_gains_above_min_delta_and_asks_after_patience():
    stopper = EarlyStopping(monitor="val_accuracy", mode="max", patience=2, min_delta=0.01)
    # 0.5 best; 0.505 is within min_delta (no gain); 0.6 a gain (waiting resets); 0.6, 0.59: two without.
    reasons = evaluate(stopper, [0.5, 0.505, 0.6, 0.6, 0.59])
    assert (stopper.best, stopper.best_step, stopper.waited) == (0.6, 3, 2)
    assert reasons == ["early stopping: val_accuracy has not improved on 0.6 (step 3) by more than 0.01 in 2 evaluations"]


def test_min_mode_keeps_going_while_the_metric_falls():
    stopper = EarlyStopping(monitor="val_loss", patience=1)
    trainer = Asked()
    for step, value in enumerate([3.0, 2.0, 1.5, 1.4], start=1):
        stopper.on_evaluation_end(trainer, step, {"val_loss": value})
    assert trainer.reasons == [] and stopper.best_step == 4


@pytest.mark.parametrize("settings,message", [
    (dict(mode="lowest"), "mode=...\\) must be 'min' or 'max'"),
    (dict(patience=0), "patience=...\\) must be a whole number >= 1"),
    (dict(min_delta=-1.0), "min_delta=...\\) must be a finite number >= 0"),
])
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**settings)


def test_only_callbacks_are_accepted_and_called_in_order():
    calls = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def on_step_end(self, trainer, step):
            calls.append((self.name, step))

    callbacks = Callbacks(trainer=None, callbacks=[Named("a"), Named("b")])
    callbacks.call("on_step_end", 7)
    assert calls == [("a", 7), ("b", 7)]
    with pytest.raises(TypeError, match="callbacks must be hvdtrain Callback instances"):
        Callbacks(trainer=None, callbacks=[lambda trainer: None])

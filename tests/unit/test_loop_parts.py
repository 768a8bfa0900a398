"""The loop's parts on one process: batches of any structure, metrics that mean something, the
fp16 loss scale, and clipping's arithmetic against torch's own."""
import copy
from collections import namedtuple

import pytest
import torch
import torch.nn.functional as F

from hvdtrain.strategies import clipping
from hvdtrain.components.precision import Precision
from hvdtrain.components.steps import batch_size, supervised_step, to_device

Pair = namedtuple("Pair", "inputs targets")


def test_batches_of_any_structure_keep_their_shape_and_size():
    batch = {"ids": torch.zeros(5, 7, dtype=torch.long), "extra": [torch.ones(5), "text"],
             "pair": Pair(torch.ones(5, 2), torch.zeros(5))}
    moved = to_device(batch, torch.device("cpu"))
    assert type(moved["pair"]) is Pair and moved["extra"][1] == "text"
    assert batch_size(batch) == 5
    assert batch_size((["no tensor here"], torch.ones(3, 1))) == 3
    with pytest.raises(TypeError, match="cannot tell the batch size of a dict"):
        batch_size({"text": "no tensors"})


def test_accuracy_is_reported_for_classes_and_not_for_a_regression():
    classify = supervised_step(F.cross_entropy)
    model = torch.nn.Linear(3, 4)
    inputs, labels = torch.randn(8, 3), torch.randint(0, 4, (8,))
    loss, metrics = classify(model, (inputs, labels))
    expected = (model(inputs).argmax(1) == labels).double().mean()
    assert set(metrics) == {"accuracy"} and torch.equal(metrics["accuracy"], expected)
    assert torch.equal(loss, F.cross_entropy(model(inputs), labels))

    regress = supervised_step(F.mse_loss)
    _, metrics = regress(torch.nn.Linear(3, 1), (inputs, torch.randn(8, 1)))
    assert metrics == {}


def test_fp16_loss_scale_backs_off_on_inf_grows_after_good_steps_and_round_trips():
    precision = Precision("fp16", torch.device("cpu"), init_scale=8.0, growth_interval=2)
    gradient = torch.tensor([8.0, -16.0])
    assert precision.unscale_and_check([gradient], sharded=False, name="t")
    assert torch.equal(gradient, torch.tensor([1.0, -2.0])), "unscaled by 1/8"
    poisoned = torch.tensor([float("inf"), 1.0])
    assert not precision.unscale_and_check([poisoned], sharded=False, name="t")
    assert precision.scale == 4.0 and precision.skipped_steps == 1
    assert torch.equal(poisoned[1:], torch.tensor([1.0])), "a skipped step leaves the gradients alone"
    for _ in range(2):
        assert precision.unscale_and_check([torch.ones(2)], sharded=False, name="t")
    assert precision.scale == 8.0, "two good steps in a row grow the scale back"

    resumed = Precision("fp16", torch.device("cpu"))
    resumed.load_state_dict(copy.deepcopy(precision.state_dict()))
    assert resumed.state_dict() == precision.state_dict()
    bf16 = Precision("bf16", torch.device("cpu"))
    bf16.load_state_dict(precision.state_dict())
    assert bf16.scale == 1.0 and bf16.scale_loss(torch.tensor(3.0)) == 3.0, "bf16 never scales"
    with pytest.raises(ValueError, match="choose one of fp32, bf16, fp16"):
        Precision("fp8", torch.device("cpu"))


def test_replicated_clipping_is_torchs_clip_grad_norm():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    F.mse_loss(model(torch.randn(4, 5)), torch.randn(4, 2)).backward()
    twin = copy.deepcopy(model)
    for mine, theirs in zip(model.parameters(), twin.parameters()):
        theirs.grad = mine.grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.01)
    norm = clipping.clip_replicated([p.grad for p in model.parameters()], 0.01)
    assert norm == float(expected) and norm > 0.01
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))


def test_the_epoch_line_without_a_train_loss_when_the_epoch_had_no_step_of_its_own():
    """Horovod elastic can roll back to a commit at an epoch's last step: the epoch then ends with
    no step, and no train loss, of its own (it used to raise KeyError on every rank)."""
    from hvdtrain.observability.reporting import epoch_line

    full = {"epoch": 2, "epochs_done": 3.0, "step": 30, "train_loss": 0.25, "samples_per_sec": 100.0, "val_loss": 0.5,
            "val_accuracy": 0.9}
    assert epoch_line(full, 5) == "epoch 2 done (3/5 epochs) step 30 train_loss 0.2500 val_loss 0.5000 val_accuracy 0.9000 100 samples/s"
    empty = {key: value for key, value in full.items() if key != "train_loss"}
    assert epoch_line(empty, 5) == "epoch 2 done (3/5 epochs) step 30 val_loss 0.5000 val_accuracy 0.9000 100 samples/s"

"""SyncBatchNorm in one process: conversion keeps every value and flag, and wherever there is nothing to
synchronize (eval mode, one process) the layer is torch's BatchNorm, bitwise."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from hvdtrain.components.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def mixed_model() -> nn.Module:
    """BatchNorms of every kind and setting, nested, with state that a fresh layer would not have."""
    torch.manual_seed(3)
    model = nn.Sequential(
        nn.BatchNorm1d(4, eps=1e-3, momentum=None),
        nn.Sequential(nn.Conv2d(2, 3, 1), nn.BatchNorm2d(3, momentum=0.3)),
        nn.BatchNorm3d(2, affine=False),
        nn.BatchNorm2d(5, track_running_stats=False).double(),
        nn.Linear(4, 4),
    )
    for layer in model.modules():
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                for tensor in (layer.weight, layer.bias, layer.running_mean, layer.running_var):
                    if tensor is not None:
                        tensor.uniform_(0.5, 1.5)
            if layer.num_batches_tracked is not None:
                layer.num_batches_tracked.fill_(7)
    model[1][1].weight.requires_grad_(False)
    model[1].eval()
    return model


def test_conversion_keeps_the_tensors_values_settings_and_flags():
    model = mixed_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    originals = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    others = [model[1][0], model[4]]

    converted = convert_sync_batchnorm(model)
    layers = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    assert converted is model  # converted in place below the top
    assert [type(m) for m in layers] == [SyncBatchNorm] * 4
    assert [m.name for m in layers] == ["0", "1.1", "2", "3"]  # the qualified names: the collectives' names
    assert [converted[1][0], converted[4]] == others  # the other modules untouched
    for old, new in zip(originals, layers):
        for key in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked"):
            assert getattr(new, key) is getattr(old, key), key  # the same tensors: an optimizer keeps them
        for key in ("num_features", "eps", "momentum", "affine", "track_running_stats", "training"):
            assert getattr(new, key) == getattr(old, key), key
    assert not layers[1].weight.requires_grad and layers[1].bias.requires_grad
    assert not layers[1].training and layers[0].training
    assert layers[3].running_mean is None and layers[3].weight.dtype == torch.float64
    assert layers[2].weight is None and layers[2].running_var.dtype == torch.float32
    after = converted.state_dict()
    assert list(after) == list(before)  # a plain model's checkpoint loads, and the other way round
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_a_batchnorm_at_the_top_is_replaced_and_synchronized_layers_are_left_alone():
    top = convert_sync_batchnorm(nn.BatchNorm2d(3), prefix="student")
    assert isinstance(top, SyncBatchNorm) and top.name == "student"
    assert convert_sync_batchnorm(top) is top
    torch_sync = nn.SyncBatchNorm(3)
    assert convert_sync_batchnorm(nn.Sequential(torch_sync))[0] is torch_sync
    assert convert_sync_batchnorm(nn.Sequential(nn.BatchNorm1d(2)), prefix="teacher")[0].name == "teacher.0"


def test_a_lazy_batchnorm_must_run_once_before_conversion():
    with pytest.raises(ValueError, match="lazy"):
        convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()))


def test_inputs_need_a_batch_and_a_channel_dimension():
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        SyncBatchNorm(3)(torch.ones(3))


def forward_backward(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor):
    x = x.clone().requires_grad_(True)
    out = layer(x)
    out.backward(upstream)
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    buffers = [b.clone() for b in layer.buffers()]
    return [out.detach()] + grads + buffers


def bitwise_report() -> dict:
    """For BatchNorm1d/2d/3d, in training (momentum and cumulative) and in eval mode: whether
    SyncBatchNorm's outputs, gradients and buffers equal torch's BatchNorm's bit for bit."""
    import horovod.torch as hvd

    generator = torch.Generator().manual_seed(5)
    cases = {
        "1d": (nn.BatchNorm1d(4), (6, 4)),
        "1d_sequence": (nn.BatchNorm1d(4, momentum=None), (6, 4, 5)),
        "2d": (nn.BatchNorm2d(3), (5, 3, 4, 4)),
        "3d": (nn.BatchNorm3d(2, momentum=None), (3, 2, 3, 3, 3)),
    }
    report = {"world_size": hvd.size() if hvd.is_initialized() else 0}
    for name, (plain, shape) in cases.items():
        with torch.no_grad():
            plain.weight.uniform_(0.5, 1.5, generator=generator)
            plain.bias.uniform_(-1, 1, generator=generator)
        synced = convert_sync_batchnorm(copy.deepcopy(plain))
        for mode in ("train", "eval"):
            plain.train(mode == "train")
            synced.train(mode == "train")
            for step in range(2):  # two steps: the running statistics are used and updated
                x = torch.randn(*shape, generator=generator) * 2 + 1
                upstream = torch.randn(*shape, generator=generator)
                for layer in (plain, synced):
                    layer.zero_grad()
                expected, got = forward_backward(plain, x, upstream), forward_backward(synced, x, upstream)
                report[f"{name}.{mode}.{step}"] = all(torch.equal(a, b) for a, b in zip(expected, got))
    return report


def test_eval_mode_and_a_process_without_horovod_are_torchs_batchnorm_bitwise():
    report = bitwise_report()
    assert report.pop("world_size") in (0, 1)
    assert all(report.values()), report


CHILD = """
import json
import horovod.torch as hvd
hvd.init()
from tests.unit.test_sync_batchnorm import bitwise_report
print(json.dumps(bitwise_report()))
"""


def test_horovod_with_one_process_is_torchs_batchnorm_bitwise():
    # In a child process: Horovod's MPI start-up sets variables in the C environment that this
    # process's later tests (and the processes they launch) would inherit.
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report.pop("world_size") == 1
    assert len(report) == 16 and all(report.values()), report

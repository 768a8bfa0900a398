"""train.compile: the model's forward through torch.compile, the module itself kept.

Only the forward is compiled, in place: the model stays the same ``nn.Module`` object, so the
strategy's hooks stay on its parameters, its ``state_dict`` keys are unchanged, and checkpoints and
the exported model.safetensors are what an uncompiled run writes. Its ``forward`` becomes the
compiled function of its class's forward, bound to it (a deep copy of the model binds it to the copy).
Not ``torch.compile(model)``: that returns a wrapper whose ``state_dict`` keys carry an
``_orig_mod.`` prefix. Not ``model.compile()``: under torch 2.13 it silently runs eager for a model
of torch's own classes (an ``nn.Sequential``) without module hooks (pytorch/pytorch#150915).

AOTAutograd compiles the backward too, as one autograd node: every parameter's gradient comes out
of it at the end of backward, and only then do Horovod's hooks (ddp) and ZeRO's (zero1, zero2) start
the reductions. The result is the same; the reductions no longer overlap the backward.

Compilation is lazy: the first training step compiles (tens of seconds on a small CPU), the first
evaluation once more (no autograd, eval mode); another input shape may compile again.

On CPU, Inductor's layout optimization (convolutions in channels-last) is off: under torch 2.13 it
returns zero gradients for the convolutions of a small CNN (the digits CNN: 1 -> 32 -> 64 channels,
max-pool, two dense layers; float32 and float64), which then trains its dense layers only, silently.
"""
from __future__ import annotations

import types

import torch


def check_compiler(device: torch.device) -> None:
    """On CPU, Inductor writes C++ kernels and builds them with the host's C++ compiler (``$CXX``, else
    g++): without one, say so before training starts, instead of failing in the first step."""
    if device.type != "cpu":
        return
    from torch._inductor import cpp_builder, exc  # private, but Inductor's own search

    try:
        cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler as error:
        raise RuntimeError(
            f"train.compile=true on CPU needs a C++ compiler: torch.compile's Inductor backend generates "
            f"C++ kernels and builds them on every host, and it found none ({error}). Install one "
            f"(Debian/Ubuntu: apt-get install g++, which scripts/setup.sh installs for Horovod's build "
            f"anyway) or point CXX at one, or train without --train.compile") from error


def compile_forward(model: torch.nn.Module, device: torch.device) -> None:
    """Replace ``model.forward`` by its compiled version, bound to ``model`` (see the module text);
    on CPU, first check that there is a C++ compiler."""
    if "forward" in vars(model):
        raise ValueError(
            "train.compile=true compiles the model's class forward, but this model has a forward of its "
            "own set on the instance (already compiled, or patched): pass the plain model")
    check_compiler(device)
    options = {"layout_optimization": False} if device.type == "cpu" else None  # see the module text
    model.forward = types.MethodType(torch.compile(type(model).forward, options=options), model)

"""train.compile: the model's forward through torch.compile, in place.

The model stays the same ``nn.Module`` (its ``forward`` becomes the compiled function bound to it),
so the strategy's hooks, the ``state_dict`` keys, checkpoints and the export are an eager run's. Not
``torch.compile(model)`` (its keys carry ``_orig_mod.``), not ``model.compile()`` (eager for torch's
own container classes under torch 2.13, pytorch/pytorch#150915). AOTAutograd compiles the backward as
one node, so the gradients' reductions start when it ends: the same result, no overlap. On CPU
Inductor's layout optimization is off: under torch 2.13 it returns zero convolution gradients for a
small CNN (the digits CNN), silently.
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

"""train.compile in one process: what it refuses, and that the model stays the module it was."""
import copy

import pytest
import torch
from torch import nn

from hvdtrain.components.compiling import check_compiler, compile_forward
from hvdtrain.config.train import TrainConfig


def test_fsdp_is_refused_with_the_reason_and_what_works():
    with pytest.raises(ValueError, match="Horovod's collectives.*ddp, zero1 or zero2, or fsdp without compile"):
        TrainConfig(strategy="fsdp", compile=True)
    for strategy in ("ddp", "zero1", "zero2"):
        assert TrainConfig(strategy=strategy, compile=True).compile


def test_a_missing_cpp_compiler_is_named_before_training(monkeypatch):
    from torch._inductor import config, cpp_builder

    monkeypatch.delenv("TORCH_INDUCTOR_INSTALL_GXX", raising=False)
    cpp_builder.cpp_compiler_search.cache_clear()
    try:
        with config.patch({"cpp.cxx": (None, "/nonexistent/g++")}), \
                pytest.raises(RuntimeError, match="needs a C\\+\\+ compiler.*apt-get install g\\+\\+"):
            check_compiler(torch.device("cpu"))
    finally:
        cpp_builder.cpp_compiler_search.cache_clear()
    check_compiler(torch.device("meta"))  # only CPU kernels are C++


def test_the_model_keeps_its_keys_and_a_copy_is_bound_to_itself():
    model = nn.Sequential(nn.Linear(3, 2))
    keys = list(model.state_dict())
    compile_forward(model, torch.device("cpu"))  # lazy: nothing is compiled before a call
    copied = copy.deepcopy(model)

    assert list(model.state_dict()) == keys
    assert copied.forward.__self__ is copied and model.forward.__self__ is model
    with pytest.raises(ValueError, match="already compiled, or patched"):
        compile_forward(model, torch.device("cpu"))

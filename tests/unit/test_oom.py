"""An allocation that fails becomes an error that says where, what was held, and what would fit."""
import pytest
import torch
from torch import nn

from hvdtrain.fault_tolerance.out_of_memory import bytes_per_rank, explain, is_out_of_memory, state_tensors_per_parameter, tried_bytes


def real_cpu_allocation_failure():
    try:
        torch.empty(2**50, dtype=torch.uint8)  # 1 PiB: no machine has it
    except RuntimeError as error:
        return error
    pytest.fail("a 1 PiB allocation succeeded")


def test_torch_allocation_failures_are_recognised_and_their_size_read():
    error = real_cpu_allocation_failure()
    assert is_out_of_memory(error) and tried_bytes(str(error)) == 2**50
    assert tried_bytes("CUDA out of memory. Tried to allocate 2.50 GiB (GPU 0; 15.78 GiB total)") == int(2.5 * 2**30)
    assert not is_out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


@pytest.mark.parametrize("workers", [1, 2, 4, 64])
def test_the_per_rank_bytes_are_the_zero_formulas_for_fp32_adam(workers):
    psi, n = 7_500_000, workers
    assert bytes_per_rank("ddp", psi, 4, 2, n) == 16 * psi
    assert bytes_per_rank("zero1", psi, 4, 2, n) == int(8 * psi + 8 * psi / n)
    assert bytes_per_rank("zero2", psi, 4, 2, n) == int(4 * psi + 12 * psi / n)
    assert bytes_per_rank("fsdp", psi, 4, 2, n) == int(16 * psi / n)


def test_optimizer_state_tensors_per_parameter():
    params = [nn.Parameter(torch.zeros(3))]
    assert state_tensors_per_parameter(torch.optim.AdamW(params)) == 2
    assert state_tensors_per_parameter(torch.optim.SGD(params, lr=0.1, momentum=0.9)) == 1
    assert state_tensors_per_parameter(torch.optim.SGD(params, lr=0.1)) == 0


def test_the_message_names_rank_phase_holdings_limit_and_a_strategy_that_would_fit():
    model = nn.Linear(1000, 1000)  # 1.0M parameters
    message = explain(real_cpu_allocation_failure(), rank=3, host="node07", phase="the optimizer step",
                      strategy="ddp", workers=4, model=model, optimizer=torch.optim.Adam(model.parameters()),
                      held={"parameters": 4_004_000, "gradients": 4_004_000, "optimizer_state": 0},
                      device=torch.device("cpu"))
    assert message.startswith("rank 3 on node07 ran out of memory during the optimizer step under strategy ddp")
    assert "it tried to allocate 1048576.0 GiB" in message  # the 1 PiB of torch's message
    assert "parameters 3.8 MiB, gradients 3.8 MiB, optimizer_state 0 B" in message
    assert "1.0M parameters and Adam keeps 2 state tensor(s) per parameter" in message
    assert "ddp 15.3 MiB; zero1 9.5 MiB; zero2 6.7 MiB; fsdp 3.8 MiB" in message
    assert "Its limit is" in message and "try --train.strategy=fsdp" in message


def test_under_hsdp_the_message_compares_what_the_rank_held():
    """hsdp's share depends on its shard groups' size, which the report does not know: it is left out of the
    figures, and the strategies that would hold less than the rank counted are proposed."""
    model = nn.Linear(1000, 1000)
    message = explain(real_cpu_allocation_failure(), rank=0, host="node01", phase="the optimizer step",
                      strategy="hsdp", workers=4, model=model, optimizer=torch.optim.Adam(model.parameters()),
                      held={"parameters": 2_002_000, "gradients": 2_002_000, "optimizer_state": 4_004_000},
                      device=torch.device("cpu"))
    assert "under strategy hsdp" in message and "hsdp " not in message.split("per rank at")[1]
    assert "try --train.strategy=fsdp" in message  # 3.8 MiB, under the 7.6 MiB held at K=2


def test_a_cuda_out_of_memory_names_the_gpu_limit_and_the_allocator_peaks(monkeypatch):
    """torch.OutOfMemoryError (torch.cuda's) as a GPU raises it: the limit is the GPU's memory and the
    allocator's peaks join what the rank held (torch.cuda's queries faked: no GPU here)."""
    class Properties:
        total_memory = 80 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 70 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 78 * 2**30)
    error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total "
                                        "capacity of 79.15 GiB of which 1.2 GiB is free.")
    assert is_out_of_memory(error)
    model = nn.Linear(1000, 1000)
    message = explain(error, rank=1, host="gpu01", phase="the forward and backward pass", strategy="zero1",
                      workers=8, model=model, optimizer=torch.optim.Adam(model.parameters()),
                      held={"parameters": 4_004_000}, device=torch.device("cuda:1"))
    assert "it tried to allocate 2.5 GiB" in message
    assert "parameters 3.8 MiB, cuda_peak_allocated 70.0 GiB, cuda_peak_reserved 78.0 GiB" in message
    assert "Its limit is 80.0 GiB (cuda:1 memory)" in message
    assert "(OutOfMemoryError: CUDA out of memory." in message

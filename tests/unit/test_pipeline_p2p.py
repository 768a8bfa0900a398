"""What a pipeline stage sends is one row of bytes on the sent tensor's own device: on a GPU the
header must not stay on the CPU (torch.cat refuses the mix, and Horovod refuses a collective whose
ranks' tensors are on different kinds of device). The "meta" device stands in for a GPU here: it
fails the same way a CUDA tensor does when the header is made on the CPU."""
import pytest
import torch

from hvdtrain.parallel.pipeline.p2p import DTYPES, pack, unpack


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool])
def test_a_packed_tensor_comes_back_whole(dtype):
    tensor = (torch.arange(24).reshape(2, 3, 4) % 5).to(dtype)
    row = pack(tensor)
    assert row.dtype == torch.uint8 and row.dim() == 1
    assert torch.equal(unpack(row), tensor) and unpack(row).dtype == dtype


def test_the_row_is_made_on_the_tensor_s_device():
    row = pack(torch.empty(2, 3, device="meta"))
    assert row.device.type == "meta"
    assert row.numel() == (2 + 2) * 8 + 2 * 3 * 4  # header: dtype code, ndim, 2 sizes (int64); then the bytes


def test_an_unsupported_dtype_is_refused_with_the_list():
    with pytest.raises(TypeError, match="cannot send a torch.complex64 tensor"):
        pack(torch.zeros(2, dtype=torch.complex64))
    assert torch.complex64 not in DTYPES

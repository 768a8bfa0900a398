"""What a pipeline stage sends is one row of bytes on the sent tensor's own device: on a GPU the
header must not stay on the CPU (torch.cat refuses the mix, and Horovod refuses a collective whose
ranks' tensors are on different kinds of device). So must the empty row of a stage with nothing to
send, and the loss placeholder of a stage without the loss. The "meta" device stands in for a GPU
here: it fails the same way a CUDA tensor does when the header is made on the CPU, and a stand-in
Horovod records the device of what each collective is given."""
import pytest
import torch

from hvdtrain.parallel.mesh import Mesh, MeshShape
from hvdtrain.parallel.pipeline import p2p, schedule
from hvdtrain.parallel.pipeline.p2p import DTYPES, StageLinks, pack, unpack


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


def test_a_stage_with_nothing_to_send_sends_an_empty_row_on_its_own_device(monkeypatch):
    """StageLinks hands the stage's device to exchange(), which makes the empty row there: a CPU row
    against the peer's GPU row is a collective Horovod refuses."""
    sent = []

    def alltoall(row, splits, name, process_set):
        sent.append((row.device.type, row.numel(), splits.tolist(), process_set))
        return torch.empty(0, dtype=torch.uint8, device=row.device), splits  # the peer sent nothing either

    monkeypatch.setattr(p2p.hvd, "alltoall", alltoall)
    links = StageLinks(Mesh(MeshShape(data=1, pipeline=2, tensor=1), rank=1, sets={(0, 1): "pair"}),
                       device=torch.device("meta"))
    assert links.recv_forward(0) is None  # the last stage asks for an activation; none came
    assert sent == [("meta", 0, [0, 0], "pair")]


def test_a_stage_without_the_loss_broadcasts_its_placeholder_on_its_own_device(monkeypatch):
    """The first of 2 stages holds no loss: the zero it hands to the loss's broadcast is made on the
    stage's device (the micro-batches'), as the last stage's loss is."""
    exchanged, broadcast = [], []

    class Links(StageLinks):
        """The exchanges on the stage's device, the next stage answering each with a gradient of ones."""

        def _exchange(self, pair, send, forward, backward):
            exchanged.append((self.device.type, None if send is None else send.device.type))
            return None if backward is None else torch.ones(2, 3, device=self.device)

    def fake_broadcast(tensor, root_rank, name, process_set):
        broadcast.append((tensor.device.type, tensor.dtype, root_rank, process_set))
        return tensor

    monkeypatch.setattr(schedule, "StageLinks", Links)
    monkeypatch.setattr(schedule.hvd, "broadcast", fake_broadcast)
    mesh = Mesh(MeshShape(data=1, pipeline=2, tensor=1), rank=0, sets={(0, 1): "pair"})
    layers = [torch.nn.Linear(4, 3, device="meta"), torch.nn.Linear(3, 2, device="meta")]
    stage = schedule.PipelineStage(layers, mesh)
    micro_batches = [(torch.empty(2, 4, device="meta"), torch.empty(2, dtype=torch.int64, device="meta"))] * 2
    loss = schedule.run_schedule("gpipe", stage, mesh, micro_batches, torch.nn.functional.cross_entropy)
    assert exchanged == [("meta", "meta"), ("meta", "meta"), ("meta", None), ("meta", None)]  # 2 sends, 2 gradients
    assert broadcast == [("meta", torch.float64, 1, "pair")] and loss.device.type == "meta"
    assert stage.layers[0].weight.grad.device.type == "meta"  # backward ran from the gradients received

"""Each rank's device, for every way a site hands out GPUs (hvdtrain.distributed.devices): decided
from counts and GPU UUIDs, so every case is checked here without a GPU."""
import types

import pytest
import torch

from hvdtrain.distributed.devices import (choose_device, device_peaks, device_refusal, sharing_refusal, shared_gpus,
                                          take_device)


def test_no_gpu_means_the_cpu():
    assert choose_device(local_rank=3, local_size=4, visible_gpus=0, host="node1") == "cpu"


@pytest.mark.parametrize("local_rank", range(4))
def test_a_host_s_gpus_are_dealt_by_local_rank(local_rank):
    assert choose_device(local_rank, local_size=4, visible_gpus=4, host="node1") == f"cuda:{local_rank}"
    assert choose_device(local_rank, local_size=4, visible_gpus=8, host="node1") == f"cuda:{local_rank}"


@pytest.mark.parametrize("local_rank", range(4))
def test_one_visible_gpu_per_task_is_that_task_s_own(local_rank):
    """srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES with one entry per rank: each sees its GPU as 0."""
    assert choose_device(local_rank, local_size=4, visible_gpus=1, host="node1") == "cuda:0"


def test_more_ranks_than_gpus_is_refused_with_the_counts_and_the_fix():
    with pytest.raises(ValueError) as refused:
        choose_device(local_rank=0, local_size=4, visible_gpus=2, host="node7")
    message = str(refused.value)
    assert "4 ranks on node7 but only 2 GPUs visible" in message
    assert "horovodrun -H node7:2" in message and "--gpus-per-task=1" in message


def test_ranks_given_the_same_gpu_are_named():
    """Every rank handed CUDA_VISIBLE_DEVICES=0 sees one GPU, but on a host it is the same one."""
    ranks = [(0, "node1", "GPU-a"), (1, "node1", "GPU-a"), (2, "node2", "GPU-a"), (3, "node2", "GPU-b")]
    problems = shared_gpus(ranks)
    assert problems == ["ranks 0, 1 on node1 use the same GPU (GPU-a)"]
    assert "srun --gpus-per-task=1" in sharing_refusal(problems)
    assert shared_gpus([(0, "node1", "GPU-a"), (1, "node1", "GPU-b")]) == []


class FakeCuda:
    """torch.cuda's two peak counters, as a GPU's allocator would report them."""

    def max_memory_allocated(self, device):
        return 3 * 2**30

    def max_memory_reserved(self, device):
        return 4 * 2**30


def test_a_gpu_rank_reports_its_allocator_peaks_and_a_cpu_rank_none():
    assert device_peaks(torch.device("cuda", 1), cuda=FakeCuda()) == {"cuda_peak_allocated": 3 * 2**30,
                                                                       "cuda_peak_reserved": 4 * 2**30}
    assert device_peaks(torch.device("cpu"), cuda=FakeCuda()) == {}


def record(rank, host, device, uuid=None, error=None):
    return {"rank": rank, "host": host, "device": device, "uuid": uuid, "error": error}


def test_the_gathered_devices_start_the_job_or_refuse_it_on_every_rank():
    """The verdict over every rank's record (the same list on every rank after the gather)."""
    healthy = [record(0, "n1", "cuda:0", "GPU-a"), record(1, "n1", "cuda:1", "GPU-b"),
               record(2, "n2", "cuda:0", "GPU-a")]
    assert device_refusal(healthy) is None  # the same UUID on two hosts is two GPUs
    assert device_refusal([record(0, "n1", "cpu"), record(1, "n2", "cpu")]) is None
    failed = "ValueError: 4 ranks on n2 but only 2 GPUs visible to each"
    refusal = device_refusal([record(0, "n1", "cuda:0", "GPU-a"), record(1, "n1", "cuda:1", "GPU-b"),
                              record(2, "n2", None, error=failed), record(3, "n2", None, error=failed),
                              record(4, "n3", None, error="RuntimeError: CUDA error: busy")])
    assert refusal == (f"no device for ranks 2, 3 on n2: {failed}; rank 4 on n3: RuntimeError: CUDA error: busy "
                       f"(all 5 ranks stop with this error)")
    mixed = device_refusal([record(0, "n1", "cuda:0", "GPU-a"), record(1, "n2", "cpu"), record(2, "n2", "cpu"),
                            record(3, "n1", "cuda:1", "GPU-b")])
    assert mixed.startswith("ranks 1, 2 on n2 see no GPU and would compute on the CPU, ranks 0, 3 on n1 on GPUs: "
                            "Horovod refuses a collective")
    assert "CUDA_VISIBLE_DEVICES=" in mixed
    shared = device_refusal([record(0, "n1", "cuda:0", "GPU-a"), record(1, "n1", "cuda:0", "GPU-a")])
    assert shared.startswith("ranks 0, 1 on n1 use the same GPU (GPU-a)")


class VisibleGpus:
    """torch.cuda as a rank sees it: ``count`` GPUs (UUIDs GPU-0, GPU-1, ...), and which was made current."""

    def __init__(self, count, broken=False):
        self.count, self.broken, self.current = count, broken, None

    def is_available(self):
        return self.count > 0

    def device_count(self):
        return self.count

    def set_device(self, device):
        if self.broken:
            raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")
        self.current = device

    def get_device_properties(self, device):
        return types.SimpleNamespace(uuid=f"GPU-{device.index}")


def test_a_rank_pins_its_gpu_after_every_rank_agreed():
    cuda, handed_in = VisibleGpus(2), []

    def gather(mine):
        handed_in.append(mine)
        return [record(0, "n1", "cuda:0", "GPU-0"), mine]

    device = take_device(rank=1, local_rank=1, local_size=2, host="n1", gather=gather, cuda=cuda)
    assert device == torch.device("cuda", 1) and cuda.current == device
    assert handed_in == [record(1, "n1", "cuda:1", "GPU-1")]


@pytest.mark.parametrize("cuda,words", [
    (VisibleGpus(2), "no device for rank 1 on n1: ValueError: 3 ranks on n1 but only 2 GPUs visible"),
    (VisibleGpus(1, broken=True), "no device for rank 1 on n1: RuntimeError: CUDA error: all CUDA-capable"),
    (VisibleGpus(0), "rank 1 on n1 sees no GPU and would compute on the CPU, rank 0 on n0 on GPUs"),
])
def test_a_rank_without_a_device_still_enters_the_gather_and_every_rank_refuses(cuda, words):
    """Before, such a rank raised (or stayed on the CPU) without entering the gather the others
    waited in, and they hung until the launcher ended the job. Now it hands in its record, and a
    healthy rank, given the same records, raises the same error."""
    handed_in = []

    def gather_on_rank_1(mine):
        handed_in.append(mine)
        return [record(0, "n0", "cuda:0", "GPU-0"), mine]

    with pytest.raises(ValueError) as on_rank_1:
        take_device(rank=1, local_rank=0, local_size=3, host="n1", gather=gather_on_rank_1, cuda=cuda)
    assert len(handed_in) == 1 and words in str(on_rank_1.value)
    with pytest.raises(ValueError) as on_rank_0:
        take_device(rank=0, local_rank=0, local_size=1, host="n0", gather=lambda mine: [mine, handed_in[0]],
                    cuda=VisibleGpus(1))
    assert str(on_rank_0.value) == str(on_rank_1.value)


def test_under_elastic_a_rank_checks_its_own_device_alone():
    """No gather (a worker joining later must run no collective at start): this rank's verdict."""
    cpu = take_device(rank=0, local_rank=0, local_size=2, host="n1", gather=None, cuda=VisibleGpus(0))
    assert cpu == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^no device for rank 0 on n1: ValueError: 3 ranks on n1 but only 2 GPUs"):
        take_device(rank=0, local_rank=0, local_size=3, host="n1", gather=None, cuda=VisibleGpus(2))

"""Each rank's device, for every way a site hands out GPUs (hvdtrain.distributed.devices): decided
from counts and GPU UUIDs, so every case is checked here without a GPU."""
import pytest

from hvdtrain.distributed.devices import choose_device, device_peaks, sharing_refusal, shared_gpus


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
    import torch

    assert device_peaks(torch.device("cuda", 1), cuda=FakeCuda()) == {"cuda_peak_allocated": 3 * 2**30,
                                                                       "cuda_peak_reserved": 4 * 2**30}
    assert device_peaks(torch.device("cpu"), cuda=FakeCuda()) == {}

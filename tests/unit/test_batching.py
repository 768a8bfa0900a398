"""A rank's loaders (hvdtrain.data.batching): the user's collate_fn makes every batch, for training
and evaluation, over the same shards; the evaluation batch size and the workers' prefetch are the
user's to set."""
import pytest
import torch
from torch.utils.data import Dataset

from hvdtrain.config.train import TrainConfig
from hvdtrain.data.batching import Batching
from hvdtrain.distributed.world import World


def world(rank, size):
    return World(rank=rank, size=size, local_rank=rank, local_size=size, cross_rank=0, cross_size=1,
                 hostname="node1", controller="mpi", launcher="test", threads=1, device=torch.device("cpu"))


class Sentences(Dataset):
    """Sample i: a sequence of i % 7 + 1 tokens (all equal to i), labelled i."""

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.full((index % 7 + 1,), index), index


def pad(samples):
    """Dynamic padding, as DataCollatorWithPadding does: to the longest sample of this batch."""
    longest = max(len(tokens) for tokens, _ in samples)
    padded = torch.zeros(len(samples), longest, dtype=torch.long)
    for row, (tokens, _) in enumerate(samples):
        padded[row, :len(tokens)] = tokens
    return {"tokens": padded, "labels": torch.tensor([label for _, label in samples])}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_user_s_collate_pads_each_batch_to_its_own_longest_sample(rank):
    config = TrainConfig(batch_size=4, eval_batch_size=10, seed=3)
    batching = Batching(config, world(rank, 2), 4, Sentences(), Sentences(), collate_fn=pad)
    batching.sampler.set_epoch(0)
    expected = list(batching.sampler)  # this rank's shard, in the epoch's order
    seen, widths = [], set()
    for batch in batching.train_loader:
        labels = batch["labels"].tolist()
        assert batch["tokens"].shape[1] == max(label % 7 + 1 for label in labels), "padded past its longest"
        assert [row[0] for row in batch["tokens"].tolist()] == labels
        seen += labels
        widths.add(batch["tokens"].shape[1])
    assert seen == expected and len(widths) > 1, "the shard, in order, with batches of different widths"
    sizes = [len(batch["labels"]) for batch in batching.val_loader]
    assert sizes == [10, 10, 10, 2], f"32 evaluation samples per rank in batches of 10: {sizes}"


def test_prefetch_needs_worker_processes_and_sizes_are_whole_numbers():
    with pytest.raises(ValueError, match="prefetch_factor=4 needs DataLoader worker processes.*num_workers > 0"):
        TrainConfig(prefetch_factor=4)
    assert TrainConfig(prefetch_factor=4, num_workers=2).prefetch_factor == 4
    with pytest.raises(ValueError, match=r"TrainConfig\.eval_batch_size must be a whole number >= 1 or None, got 0"):
        TrainConfig(eval_batch_size=0)


def numbers():
    """A stream without len(): a function that opens it per epoch."""
    return iter(range(100))


def test_a_stream_without_len_warms_up_in_steps_and_refuses_epochs():
    with pytest.raises(ValueError, match=r"train.warmup_steps=N"):
        Batching(TrainConfig(batch_size=4, max_steps=50, warmup_epochs=1), world(0, 2), 4, numbers, None)
    batching = Batching(TrainConfig(batch_size=4, max_steps=50, warmup_epochs=1, warmup_steps=7), world(0, 2), 4,
                        numbers, None)
    assert (batching.steps_per_epoch, batching.warmup_steps, batching.total_steps) == (None, 7, 50)
    # Sized data: the steps replace the epochs' count all the same.
    sized = Batching(TrainConfig(batch_size=4, warmup_epochs=1, warmup_steps=3), world(0, 2), 4, Sentences(), None)
    assert (sized.steps_per_epoch, sized.warmup_steps) == (64 // 8, 3)
    with pytest.raises(ValueError, match="warmup_steps must be a whole number"):
        TrainConfig(warmup_steps=-1)

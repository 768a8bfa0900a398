"""A rank's loaders (hvdtrain.data.batching): the user's collate_fn makes every batch, for training
and evaluation, over the same shards; the evaluation batch size and the workers' prefetch are the
user's to set."""
import dataclasses

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


@pytest.mark.parametrize("setting,device,pinned", [("auto", "cpu", False), ("auto", "cuda", True),
                                                    ("false", "cuda", False), ("true", "cuda", True)])
def test_pin_memory_pins_every_loader_of_the_run_as_set(setting, device, pinned):
    """train.pin_memory: auto pins for a GPU only (the default, as before the setting), false never,
    true always; the evaluation loaders as the training one."""
    on_device = dataclasses.replace(world(0, 2), device=torch.device(device))
    batching = Batching(TrainConfig(batch_size=4, pin_memory=setting), on_device, 4, Sentences(), Sentences())
    loaders = [batching.train_loader, batching.val_loader, batching.evaluation_loader(Sentences())]
    assert [loader.pin_memory for loader in loaders] == [pinned] * 3


def test_pin_memory_true_on_a_cpu_device_is_refused():
    with pytest.raises(ValueError, match=r"train.pin_memory=true pins the batches for copies to a GPU, and this "
                                         r"rank's device is cpu: set train.pin_memory=auto .* or false"):
        Batching(TrainConfig(batch_size=4, pin_memory="true"), world(0, 2), 4, Sentences(), None)


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


def own_loader(dataset, sampler, batch_size):
    """Your own DataLoader over hvdtrain's sampler: persistent workers and a worker_init_fn of yours."""
    from torch.utils.data import DataLoader
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, collate_fn=pad, num_workers=2,
                      persistent_workers=True, worker_init_fn=lambda worker: torch.set_num_threads(1))


@pytest.mark.parametrize("rank", [0, 1])
def test_your_own_loader_over_the_sampler_gives_the_batches_hvdtrain_s_would(rank):
    config = TrainConfig(batch_size=4, seed=3, accumulation=2)
    own = Batching(config, world(rank, 2), 4, Sentences(), Sentences(), loader_factory=own_loader)
    hvdtrain_s = Batching(config, world(rank, 2), 4, Sentences(), Sentences(), collate_fn=pad)
    for epoch in (0, 1):
        own.sampler.set_epoch(epoch)
        hvdtrain_s.sampler.set_epoch(epoch)
        for mine, theirs in zip(own.train_loader, hvdtrain_s.train_loader, strict=True):
            assert torch.equal(mine["tokens"], theirs["tokens"]) and torch.equal(mine["labels"], theirs["labels"])
    evaluated = [batch["labels"] for batch in own.val_loader]
    assert torch.cat(evaluated).tolist() == list(range(rank, 64, 2)), "evaluation: this rank's half, in order, once"
    assert own.train_loader.generator is not None, "its epochs must not draw from torch's global generator"


def test_a_loader_that_bypasses_the_sampler_is_refused_with_what_to_change():
    from torch.utils.data import DataLoader
    config = TrainConfig(batch_size=4)
    shuffled = lambda dataset, sampler, batch_size: DataLoader(dataset, batch_size=batch_size, shuffle=True)
    with pytest.raises(ValueError, match="does not read through the sampler it is given"):
        Batching(config, world(0, 2), 4, Sentences(), None, loader_factory=shuffled)
    bigger = lambda dataset, sampler, batch_size: DataLoader(dataset, batch_size=8, sampler=sampler, drop_last=True)
    with pytest.raises(ValueError, match=r"its batch size is 8, not the 4 .*drops the last batch"):
        Batching(config, world(0, 2), 4, Sentences(), None, loader_factory=bigger)
    with pytest.raises(ValueError, match="give the loader its collate_fn in your loader_factory"):
        Batching(config, world(0, 2), 4, Sentences(), None, collate_fn=pad, loader_factory=own_loader)
    with pytest.raises(ValueError, match="a stream has none"):
        Batching(TrainConfig(batch_size=4, max_steps=5, warmup_steps=0), world(0, 2), 4, numbers, None,
                 loader_factory=own_loader)


def test_another_set_s_loader_takes_the_run_s_collate_or_the_one_given():
    """Session.loader: any data set, in order, this rank's half, made by the run's collate_fn unless
    another is given (then with hvdtrain's loader)."""
    batching = Batching(TrainConfig(batch_size=4, eval_batch_size=8), world(1, 2), 4, Sentences(), None,
                        collate_fn=pad)
    padded = list(batching.evaluation_loader(Sentences()))
    assert [len(batch["labels"]) for batch in padded] == [8, 8, 8, 8]
    assert torch.cat([batch["labels"] for batch in padded]).tolist() == list(range(1, 64, 2))
    labels_only = lambda samples: torch.tensor([label for _, label in samples])
    assert torch.cat(list(batching.evaluation_loader(Sentences(), 16, labels_only))).tolist() == list(range(1, 64, 2))
    own = Batching(TrainConfig(batch_size=4), world(0, 2), 4, Sentences(), None, loader_factory=own_loader)
    assert own.evaluation_loader(Sentences()).num_workers == 2, "the run's own loaders serve other sets too"


def test_a_port_with_default_settings_steps_at_its_scripts_rate_from_the_first_step():
    """Horovod's pytorch_mnist at 2 workers: SGD at lr x hvd.size() from its first step, no warm-up.
    The port deletes the `* hvd.size()` (train.scale_lr does it) and with the defaults steps at the
    same rate at every step (with the old default, a one-epoch warm-up from one worker's rate, its
    first epoch stepped slower than the script's)."""
    from hvdtrain.components.lr import LearningRate

    config = TrainConfig(batch_size=16, epochs=3)
    two = world(0, 2)
    batching = Batching(config, two, 16, Sentences(), None)
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.05, momentum=0.9)
    rate = LearningRate(config, optimizer)
    rate.start(batching.global_batch_size, batching.warmup_steps, two, 0, batching.total_steps)
    seen = []
    for _ in range(batching.total_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        rate.step()
    assert seen == [0.05 * 2] * batching.total_steps

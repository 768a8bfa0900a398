"""Streams (IterableDataset, Hugging Face streaming, a function over files) across ranks: every
sample of an epoch taken once across ranks and DataLoader workers, whole global batches only, and
the Trainer's epochs ending when the stream runs out, on every rank at the same step."""
import pytest
import torch
from torch.utils.data import IterableDataset

from hvdtrain.config.train import TrainConfig
from hvdtrain.data.streaming import stream_loader
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import small_mlp

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank takes the whole stream"),
    pytest.mark.np4(reason="each rank's part of the stream and the epoch's last step change with the world size"),
]
SAMPLES = 50  # not a multiple of the global batches below: a tail is dropped in training


class ShuffledIds(IterableDataset):
    """Samples (features, label, id), in an order seeded by the epoch (as a shuffled stream is);
    with ``sized`` it has a len()."""

    def __init__(self, samples: int = SAMPLES, sized: bool = True) -> None:
        self.samples, self.sized, self.epoch = samples, sized, 0
        generator = torch.Generator().manual_seed(3)
        self.inputs = torch.randn(samples, 12, generator=generator, dtype=torch.float64)
        self.labels = torch.randint(0, 4, (samples,), generator=generator)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.samples, generator=torch.Generator().manual_seed(100 + self.epoch))
        for i in order.tolist():
            yield self.inputs[i], self.labels[i], torch.tensor(i)

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("no len")
        return self.samples


@pytest.mark.parametrize("workers", [0, 2])
def test_every_sample_once_per_epoch_across_ranks_and_loader_workers(world, workers):
    stream = ShuffledIds()
    batch = 3
    global_batch = batch * world.size
    training = stream_loader(stream, batch, world.rank, world.size, seed=0, global_batch=global_batch,
                             num_workers=workers)
    evaluation = stream_loader(stream, batch, world.rank, world.size, seed=0, num_workers=workers)
    seen = {}
    for epoch in (0, 1):
        training.dataset.set_epoch(epoch)
        seen[epoch] = [int(i) for _, _, ids in training for i in ids]
    evaluation.dataset.set_epoch(0)
    evaluated = [int(i) for _, _, ids in evaluation for i in ids]
    gathered = collectives.allgather_object((seen, evaluated), name="stream.ids")

    whole = SAMPLES // global_batch * global_batch
    for epoch in (0, 1):
        union = [i for rank_seen, _ in gathered for i in rank_seen[epoch]]
        assert len(union) == whole and len(set(union)) == whole, f"epoch {epoch}: repeated or missing samples"
        order = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(100 + epoch)).tolist()
        assert set(union) == set(order[:whole]), "not the stream's first whole global batches"
    assert seen[0] != seen[1], "the epoch's order did not reach the stream (set_epoch)"
    union = [i for _, rank_evaluated in gathered for i in rank_evaluated]
    assert sorted(union) == list(range(SAMPLES)), "evaluation must take every sample exactly once"


def id_recording_step(seen):
    def step(model, batch):
        inputs, labels, ids = batch
        seen.extend(int(i) for i in ids)
        return torch.nn.functional.cross_entropy(model(inputs), labels), {}
    return step


@pytest.mark.parametrize("sized", [True, False])
def test_the_trainer_ends_each_epoch_when_the_stream_runs_out(world, sized):
    """Without len() the defaults work: train.epochs passes, each ended by the stream (it used to be
    refused twice in a row: max_steps first, then the default warm-up's epochs)."""
    seen = []
    model = small_mlp(seed=1)
    config = TrainConfig(seed=5, batch_size=3, epochs=2, log_every=1, progress="off", run_dir=None,
                         **({"warmup_epochs": 1} if sized else {}))
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ShuffledIds(sized=sized),
                      ShuffledIds(), config, world=world, step_fn=id_recording_step(seen))
    history = trainer.fit()
    gathered = collectives.allgather_object(seen, name="stream.trainer.ids")

    global_batch = 3 * world.size
    steps = SAMPLES // global_batch
    assert trainer.global_step == 2 * steps, "two epochs of whole global batches"
    assert [record["step"] for record in history] == [steps, 2 * steps]
    assert trainer.parts.batching.steps_per_epoch == (steps if sized else None)
    for epoch in (0, 1):
        # The training ids of this epoch on every rank (evaluation's follow each epoch's training).
        union = []
        for rank_seen in gathered:
            per_epoch = len(rank_seen) // 2
            union += rank_seen[epoch * per_epoch: epoch * per_epoch + steps * 3]
        assert len(set(union)) == len(union) == steps * global_batch, f"epoch {epoch}: a sample twice or lost"
    assert history[-1]["val_samples"] == SAMPLES


def test_an_unsized_stream_refuses_a_decay_to_a_last_step_it_cannot_count(world):
    model = small_mlp(seed=1)
    with pytest.raises(ValueError, match="lr_schedule=cosine decays to the run's last step.*set train.max_steps"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ShuffledIds(sized=False), None,
                TrainConfig(batch_size=3, progress="off", run_dir=None, lr_schedule="cosine"), world=world)
    with pytest.raises(ValueError, match="your lr_scheduler takes the run's total steps"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), ShuffledIds(sized=False), None,
                TrainConfig(batch_size=3, progress="off", run_dir=None), world=world,
                lr_scheduler=lambda optimizer, total: torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=total))


def test_a_generator_object_is_refused_and_a_function_over_files_is_read_per_epoch(world):
    opened = []

    def lines(epoch):  # as a generator over files would: a new one per epoch
        opened.append(epoch)
        return ((torch.zeros(12, dtype=torch.float64), torch.tensor(0), torch.tensor(i)) for i in range(SAMPLES))

    with pytest.raises(TypeError, match="generator object"):
        stream_loader(lines(0), 3, world.rank, world.size, seed=0)
    loader = stream_loader(lines, 3, world.rank, world.size, seed=0)
    loader.dataset.set_epoch(4, start=world.size * 2)
    ids = [int(i) for _, _, batch in loader for i in batch]
    assert opened == [0, 4]
    assert ids == list(range(world.size * 2 + world.rank, SAMPLES, world.size)), "a resumed epoch skips its start"


def test_a_dataloader_passed_as_the_dataset_is_refused(world):
    from torch.utils.data import DataLoader
    model = small_mlp(seed=1)
    with pytest.raises(TypeError, match="a DataLoader is not a dataset: .*pass its dataset"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(ShuffledIds(), batch_size=3), None,
                TrainConfig(batch_size=3, progress="off", run_dir=None), world=world)


def test_a_hugging_face_streaming_dataset_trains_each_sample_once_per_epoch_in_its_shuffled_order(world, tmp_path):
    """datasets.load_dataset(..., streaming=True), shuffled: an IterableDataset whose order follows
    set_epoch (its seed + the epoch), no len(); the Trainer shards it, each epoch in its own order."""
    datasets = pytest.importorskip("datasets")
    import json
    base = collectives.allgather_object(str(tmp_path), name="stream.hf.dir")[0]  # rank 0 writes, all read
    path = f"{base}/samples.jsonl"
    if world.rank == 0:
        generator = torch.Generator().manual_seed(3)
        with open(path, "w") as out:
            for i in range(SAMPLES):
                features = torch.randn(12, generator=generator, dtype=torch.float64).tolist()
                out.write(json.dumps({"inputs": features, "labels": i % 4, "ids": i}) + "\n")
    collectives.allgather_object(None, name="stream.hf.written")
    stream = datasets.load_dataset("json", data_files=path, split="train", streaming=True)
    stream = stream.shuffle(seed=7, buffer_size=SAMPLES).with_format("torch")

    seen = []
    def step(model, batch):
        seen.append([int(i) for i in batch["ids"]])
        return torch.nn.functional.cross_entropy(model(batch["inputs"].double()), batch["labels"]), {}

    model = small_mlp(seed=1)
    config = TrainConfig(seed=5, batch_size=3, epochs=2, max_steps=100, warmup_steps=2, log_every=1000,
                         progress="off", run_dir=None)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), stream, None, config, world=world,
                      step_fn=step)
    trainer.fit()
    gathered = collectives.allgather_object(seen, name="stream.hf.ids")

    global_batch = 3 * world.size
    steps = SAMPLES // global_batch
    assert trainer.global_step == 2 * steps, "two epochs of whole global batches, each ended by the stream"
    epochs = [[i for rank_seen in gathered for batch in rank_seen[epoch * steps:(epoch + 1) * steps] for i in batch]
              for epoch in (0, 1)]
    for union in epochs:
        assert len(union) == len(set(union)) == steps * global_batch, "a sample twice or lost in an epoch"
    # Shuffled anew each epoch by the dataset itself, every rank alike (else the shards would overlap).
    firsts = [[gathered[rank][epoch][0] for rank in range(world.size)] for epoch in (0, 1)]
    assert firsts[0] != firsts[1], firsts

"""Iterable and streaming datasets across ranks: one global stream, each rank its slice.

The source, one of:

* an iterable that starts over at every ``iter()`` (a torch IterableDataset, a Hugging Face
  ``load_dataset(..., streaming=True)`` dataset; an object with ``__getitem__`` is map-style
  instead); if it has ``set_epoch(epoch)`` it is called before each epoch (Hugging Face
  reshuffles its shards and buffer with it);
* a function ``open(epoch) -> iterator`` (a generator over files, say): called once per epoch.

The contract: for a given epoch the source yields the same samples in the same order on every
rank (every rank reads the whole stream and keeps its slice; a source that is random must be
seeded by the epoch). A single-use generator object cannot be read twice and is refused.

Sharding mirrors ShardedSampler's: counted from where the epoch (re)starts, the stream's sample
q goes to rank q % world_size, so micro-batch k of every rank together is samples
[k*B*W, (k+1)*B*W) of the stream, at any world size. Within a rank, DataLoader worker w builds
the rank's micro-batches k with k % num_workers == w, which DataLoader's round-robin puts back in
order: no sample twice, none lost.

Training takes whole global batches only: the stream is read a global batch at a time, and an
incomplete last global batch (the stream's length modulo the global batch) is dropped on every
rank alike, so every rank takes the same number of steps and none waits for another in the
all-reduce. Evaluation (no global batch) takes every sample once; shards may differ by one.

The position is the number of stream samples of the epoch already trained on (the Trainer's
``epoch_position``, kept in checkpoints as for map-style datasets). A resume skips that many: by
``source.iter_from(epoch, start)`` when the source has it (one that can seek, e.g. to a file and
line), else by reading and discarding them. Since the order does not depend on the world size,
a checkpoint resumes exactly at the same data-parallel size, and at another one as well (the
Trainer keeps the checkpoint's global batch).
"""
from __future__ import annotations

import inspect
import itertools
from typing import Any, Callable, Iterator, List, Optional

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info


def is_stream(dataset: Any) -> bool:
    """Whether ``dataset`` is read as a stream (no index): an IterableDataset, an iterable without
    ``__getitem__`` (Hugging Face streaming), or a function that opens a stream per epoch."""
    if isinstance(dataset, DataLoader):
        raise TypeError("a DataLoader is not a dataset: hvdtrain builds each rank's loader over its shard (an own "
                        "loader over the whole data would give every rank the same batches); pass its dataset, and "
                        "its collate_fn as the Trainer's collate_fn, num_workers/prefetch_factor as train settings; or "
                        "build it in loader_factory(dataset, sampler, batch_size) over hvdtrain's sampler")
    if isinstance(dataset, (IterableDataset, StreamShards)):
        return True
    if hasattr(dataset, "__getitem__"):
        return False
    return callable(dataset) or hasattr(dataset, "__iter__")


def stream_length(dataset: Any) -> Optional[int]:
    """The stream's sample count when it says (``len()``), else None (unknown, maybe infinite)."""
    try:
        return int(len(dataset))  # type: ignore[arg-type]
    except (TypeError, NotImplementedError, AttributeError):
        return None


class StreamShards(IterableDataset):
    """This rank's share of a stream, a micro-batch at a time (see the module's docstring). The Trainer calls
    ``set_epoch(epoch, start)`` before each epoch, as it does ShardedSampler's.

    Args:
        source: the stream: an IterableDataset, a Hugging Face streaming dataset, or a function that opens one per
            epoch.
        rank: this rank's index among the data-parallel ranks.
        world_size: data-parallel ranks.
        batch_size: samples per worker per micro-batch.
        global_batch: samples per optimizer step, every rank's together (training: whole global batches only); None for
            evaluation.
    """

    def __init__(self, source: Any, rank: int, world_size: int, batch_size: int,
                 global_batch: Optional[int] = None) -> None:
        if inspect.isgenerator(source) or isinstance(source, Iterator):
            raise TypeError("a stream is read once per epoch and once per rank, so a generator object (which can be "
                            "read only once) cannot be one: pass the function that makes it (called with the "
                            "epoch), or an iterable whose iter() starts over")
        if not (callable(source) or hasattr(source, "__iter__")):
            raise TypeError(f"a stream must be an iterable or a function open(epoch) -> iterator; got "
                            f"{type(source).__name__}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of size {world_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if global_batch is not None and (global_batch < 1 or global_batch % (batch_size * world_size)):
            raise ValueError(f"global_batch {global_batch} must be a positive multiple of batch_size x world size "
                             f"({batch_size} x {world_size})")
        self.source, self.rank, self.world_size = source, rank, world_size
        self.batch_size, self.global_batch = batch_size, global_batch
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """The epoch to read, and how many of its stream samples were already trained on."""
        if start < 0:
            raise ValueError(f"start {start} must be >= 0")
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        """This rank's samples from ``start``, when the source has a length (else TypeError, as for
        any IterableDataset without one)."""
        total = stream_length(self.source)
        if total is None:
            raise TypeError(f"this stream ({type(self.source).__name__}) has no len()")
        left = max(0, total - self.start)
        if self.global_batch is not None:
            return left // self.global_batch * (self.global_batch // self.world_size)
        return len(range(self.rank, left, self.world_size))

    def open(self) -> Iterator[Any]:
        """The epoch's stream from sample ``start``."""
        source = self.source
        if hasattr(source, "iter_from"):
            return iter(source.iter_from(self.epoch, self.start))
        if hasattr(source, "set_epoch"):
            source.set_epoch(self.epoch)
        stream = iter(source(self.epoch)) if callable(source) and not hasattr(source, "__iter__") else iter(source)
        return itertools.islice(stream, self.start, None)

    def __iter__(self) -> Iterator[Any]:
        worker = get_worker_info()
        worker_id, workers = (worker.id, worker.num_workers) if worker is not None else (0, 1)
        per_round = self.batch_size * self.world_size  # stream samples per micro-batch of every rank
        stream = self.open()
        if self.global_batch is not None:
            stream = _whole_chunks(stream, self.global_batch)
        for q, sample in enumerate(stream):
            if q % self.world_size == self.rank and (q // per_round) % workers == worker_id:
                yield sample


def _whole_chunks(stream: Iterator[Any], size: int) -> Iterator[Any]:
    """The stream's samples, ``size`` at a time, without an incomplete last chunk."""
    while True:
        chunk = list(itertools.islice(stream, size))
        if len(chunk) < size:
            return
        yield from chunk


def stream_loader(source: Any, batch_size: int, rank: int, world_size: int, seed: int,
                  global_batch: Optional[int] = None, num_workers: int = 0, pin_memory: bool = False,
                  collate_fn: Optional[Callable[[List[Any]], Any]] = None,
                  prefetch_factor: Optional[int] = None) -> DataLoader:
    """A DataLoader over this rank's share of a stream, as sharded_loader's for
    map-style datasets. Its workers are not persistent: each epoch's set_epoch must reach them.

    Args:
        source: the stream (see StreamShards).
        batch_size: samples per worker per micro-batch.
        rank: this rank's index among the data-parallel ranks.
        world_size: data-parallel ranks.
        seed: seeds the DataLoader's generator (with the rank).
        global_batch: samples per optimizer step, every rank's together; None for evaluation.
        num_workers: the DataLoader's worker processes.
        pin_memory: pin the batches in page-locked memory (GPUs).
        collate_fn: makes a batch of samples (None: torch's default).
        prefetch_factor: batches each loader worker loads ahead (None: torch's default).
    """
    shards = source if isinstance(source, StreamShards) else StreamShards(source, rank, world_size, batch_size,
                                                                          global_batch)
    return DataLoader(shards, batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory,
                      collate_fn=collate_fn, prefetch_factor=prefetch_factor if num_workers else None,
                      generator=torch.Generator().manual_seed(seed + rank))


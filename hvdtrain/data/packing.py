"""Packed sequences: variable-length tokenized documents packed into rows of one length, so that a
batch carries documents instead of padding, and every document is trained as if alone.

A row is a dict of three (row_length,) int64 tensors, what a Hugging Face causal LM takes:

* ``input_ids``: the documents' tokens one after another, then ``pad_id`` up to the row's length;
* ``position_ids``: 0, 1, 2, ... restarting at every document (and at the padding), so each token
  sits at its position within its own document;
* ``labels``: ``input_ids`` with -100 at every document's first token and over the padding.
  Hugging Face causal LMs shift the labels themselves (position t is scored on ``labels[t + 1]``),
  so a document's last token is never scored on the next document's first one, nor on padding.

Attention stays within each document. No attention mask is stored: it follows from
``position_ids`` (a document starts wherever a position is not the previous one plus 1).
transformers builds that block-causal mask itself when a model gets ``position_ids``, no
``attention_mask`` and no cache (``masking_utils.find_packed_sequence_indices``); with the default
``use_cache=True`` of its configs it does not, even in training, and documents would see each
other: ``packed_lm_step`` passes ``use_cache=False``. Other models build the mask with
``block_causal_mask(position_ids)`` (the example transformer does). With both, the mean loss of a
packed batch and its gradients are those of its documents run one at a time (the sum of their
token losses over their count of scored tokens).

Packing is greedy first-fit over a few open rows, in the documents' order: each document goes into
the first open row with room for it; when none has room, the oldest open row is emitted (padded)
and a new one opened; a row that is full leaves at once. ``open_rows=1`` is sequential packing
(next-fit). A document longer than a row is cut into row-sized pieces (the last one shorter), and
each piece is a document of its own, for attention and for positions (so the target that joins
two pieces is not scored). Every token of every document is in exactly one row, once; empty
documents are skipped. Packing is deterministic, so every rank packs the same rows.

``packed(documents, row_length)`` packs a map-style dataset at once (``PackedRows``: a len(), and
the sampler shuffles rows), and a stream as it is read (``PackedStream``: no len(), so the
Trainer needs train.max_steps; a resume skips rows, which re-packing yields alike).
"""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple, Union

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset

from hvdtrain.common.labels import IGNORE_INDEX, causal_items
from hvdtrain.data.streaming import is_stream

Row = Dict[str, torch.Tensor]


def document_tokens(document: Any) -> torch.Tensor:
    """A document's token ids as a 1-D int64 tensor: from a list of ints, a 1-D tensor, or a mapping
    with ``input_ids`` (a tokenized Hugging Face dataset's row)."""
    if isinstance(document, Mapping):
        if "input_ids" not in document:
            raise ValueError(f"a document given as a mapping needs its tokens under 'input_ids'; it has "
                             f"{sorted(document)}")
        document = document["input_ids"]
    ids = torch.as_tensor(document)
    if ids.shape == (0,):  # an empty list is a float tensor to torch
        return ids.to(torch.int64)
    if ids.dim() != 1 or ids.is_floating_point() or ids.is_complex() or ids.dtype is torch.bool:
        raise ValueError(f"a document must be a 1-D sequence of integer token ids, got a {ids.dim()}-D "
                         f"{ids.dtype} tensor: pass one document per item (a list of ints or a 1-D tensor)")
    return ids.to(torch.int64)


def pieces(ids: torch.Tensor, row_length: int) -> Tuple[torch.Tensor, ...]:
    """A document in pieces of at most ``row_length`` tokens (itself when it fits)."""
    return torch.split(ids, row_length) if len(ids) else ()


def make_row(documents: List[torch.Tensor], row_length: int, pad_id: int) -> Row:
    """One row of ``documents`` (their lengths summing to at most ``row_length``), padded."""
    padding = row_length - sum(len(d) for d in documents)
    input_ids = torch.cat(documents + [torch.full((padding,), pad_id, dtype=torch.int64)])
    # The padding is a document of its own too: nothing real attends to it (it comes last) and it
    # attends to nothing real.
    position_ids = torch.cat([torch.arange(len(d)) for d in documents] + [torch.arange(padding)])
    labels = input_ids.clone()
    labels[position_ids == 0] = IGNORE_INDEX
    labels[row_length - padding:] = IGNORE_INDEX
    return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}


def _check(row_length: int, open_rows: int) -> None:
    if isinstance(row_length, bool) or not isinstance(row_length, int) or row_length < 2:
        raise ValueError(f"row_length must be a whole number >= 2 (a row scores targets from its second token on), "
                         f"got {row_length!r}")
    if isinstance(open_rows, bool) or not isinstance(open_rows, int) or open_rows < 1:
        raise ValueError(f"open_rows must be a whole number >= 1 (1: sequential packing), got {open_rows!r}")


def pack_documents(documents: Iterable[Any], row_length: int, pad_id: int = 0, open_rows: int = 8) -> Iterator[Row]:
    """The rows ``documents`` pack into (see the module's docstring), as they are read.

    Args:
        documents: any iterable of documents (lists of token ids, 1-D tensors, or mappings with
            ``input_ids``).
        row_length: tokens per row.
        pad_id: the token that fills a row's end (never scored, never attended to by a document).
        open_rows: rows filled at a time (first-fit among them); 1 packs sequentially.
    """
    _check(row_length, open_rows)
    rows: List[List[torch.Tensor]] = []  # the open rows' documents
    room: List[int] = []  # and the tokens each has left
    for document in documents:
        for piece in pieces(document_tokens(document), row_length):
            fit = next((i for i, left in enumerate(room) if left >= len(piece)), None)
            if fit is None:
                if len(rows) == open_rows:
                    yield make_row(rows.pop(0), row_length, pad_id)
                    room.pop(0)
                rows.append([])
                room.append(row_length)
                fit = len(rows) - 1
            rows[fit].append(piece)
            room[fit] -= len(piece)
            if room[fit] == 0:
                yield make_row(rows.pop(fit), row_length, pad_id)
                room.pop(fit)
    for documents_of_row in rows:
        yield make_row(documents_of_row, row_length, pad_id)


class PackedRows(Dataset):
    """A map-style dataset's documents packed into rows once, at construction (every document read).

    Args:
        documents: a map-style dataset (or list) of documents.
        row_length: tokens per row.
        pad_id: the token that fills a row's end.
        open_rows: rows filled at a time (first-fit among them); 1 packs sequentially.
    """

    def __init__(self, documents: Iterable[Any], row_length: int, pad_id: int = 0, open_rows: int = 8) -> None:
        self.row_length = row_length
        self.rows: List[Row] = list(pack_documents(documents, row_length, pad_id, open_rows))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> Row:
        return self.rows[index]


class PackedStream(IterableDataset):
    """A stream's documents packed into rows as they are read, again at every epoch. The source is
    what hvdtrain.data.streaming takes: an iterable that starts over at every ``iter()`` (with
    ``set_epoch``, passed on), or a function ``open(epoch) -> iterator``.

    Args:
        source: the documents' stream.
        row_length: tokens per row.
        pad_id: the token that fills a row's end.
        open_rows: rows filled at a time (first-fit among them); 1 packs sequentially.
    """

    def __init__(self, source: Union[Iterable[Any], Callable[[int], Iterable[Any]]], row_length: int,
                 pad_id: int = 0, open_rows: int = 8) -> None:
        if inspect.isgenerator(source) or isinstance(source, Iterator):
            raise TypeError("packed rows are read once per epoch and once per rank, so a generator object (which can "
                            "be read only once) cannot be their source: pass the function that makes it (called "
                            "with the epoch), or an iterable whose iter() starts over")
        _check(row_length, open_rows)
        self.source, self.row_length, self.pad_id, self.open_rows = source, row_length, pad_id, open_rows
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch to read (passed on to a source that has set_epoch)."""
        self.epoch = epoch
        if hasattr(self.source, "set_epoch"):
            self.source.set_epoch(epoch)

    def __iter__(self) -> Iterator[Row]:
        source = self.source
        documents = source(self.epoch) if callable(source) and not hasattr(source, "__iter__") else source
        return pack_documents(documents, self.row_length, self.pad_id, self.open_rows)


def packed(documents: Any, row_length: int, pad_id: int = 0, open_rows: int = 8) -> Union[PackedRows, PackedStream]:
    """``documents`` packed into rows of ``row_length`` tokens: a map-style dataset (or list) at once
    (PackedRows), a stream as it is read (PackedStream).

    Args:
        documents: the documents: a map-style dataset or list, or a stream.
        row_length: tokens per row.
        pad_id: the token that fills a row's end.
        open_rows: rows filled at a time (first-fit among them); 1 packs sequentially.
    """
    if is_stream(documents):
        return PackedStream(documents, row_length, pad_id, open_rows)
    return PackedRows(documents, row_length, pad_id, open_rows)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Which document of its row each token is in, numbered from 0 per row: a new one starts wherever a
    position is not the previous one plus 1 (transformers' rule, so that both read the same rows alike)."""
    previous = position_ids[..., :1] - 1
    return (torch.diff(position_ids, prepend=previous, dim=-1) != 1).cumsum(-1)


def block_causal_mask(position_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed rows for ``F.scaled_dot_product_attention``: (batch, 1, T, T),
    True where query t may attend to key s, i.e. s <= t within the same document."""
    documents = document_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    return ((documents.unsqueeze(-1) == documents.unsqueeze(-2)) & causal).unsqueeze(1)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of next-token predictions as Hugging Face causal LMs compute it:
    position t is scored on ``labels[t + 1]``, -100 labels skipped. (batch, T, vocab) logits."""
    scores = logits[:, :-1].reshape(-1, logits.shape[-1])
    return F.cross_entropy(scores, labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX)


def packed_lm_step(model: torch.nn.Module, batch: Row) -> Tuple[torch.Tensor, Dict[str, Any]]:
    """The Trainer's ``step_fn`` for packed rows. A Hugging Face model (one with a ``config``) gets
    ``input_ids``, ``position_ids`` and ``labels`` with ``use_cache=False`` (with a cache transformers
    would not detect the packing, and documents would attend to each other) and returns its own loss;
    another model is called ``model(input_ids, position_ids=position_ids)`` for logits, scored by
    causal_lm_loss."""
    # Under sequence parallelism a rank's part of the rows comes with its labels shifted over the whole
    # rows (``shift_labels``) and the whole batch's count (``num_items_in_batch``): transformers' loss takes both.
    shifted = {key: batch[key] for key in ("shift_labels", "num_items_in_batch") if key in batch}
    if getattr(model, "config", None) is not None:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"],
                     use_cache=False, **shifted).loss, {}
    if shifted:
        raise ValueError("packed_lm_step under train.sequence_parallel takes a Hugging Face model (packed rows of "
                         "a model of your own are refused there: its mask would see its part of the rows alone)")
    logits = model(batch["input_ids"], position_ids=batch["position_ids"])
    return causal_lm_loss(logits, batch["labels"]), {}


# Its loss is a mean over the rows' next-token targets: the Trainer weighs it by them
# (hvdtrain.components.token_mean), so that N workers' loss is one process's token mean.
packed_lm_step.count_items = lambda model: lambda batch: causal_items(batch["labels"])


"""Packed sequences (hvdtrain.data.packing): every token of every document in exactly one row, positions
restarting at each document, labels cut at its boundaries; and a packed batch trains exactly as its
documents one at a time (loss and gradients, float64) for Llama, Qwen3 and the example transformer."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset

from hvdtrain.data.packing import (PackedRows, PackedStream, block_causal_mask, pack_documents, packed,
                                   packed_lm_step)
from hvdtrain.examples.textlm import TinyTransformerLM
from hvdtrain.verify.exact import float64_throughout

ROW = 16


def numbered_documents(lengths):
    """Documents whose tokens are 1, 2, 3, ... across all of them: every token is told apart (0 is padding)."""
    documents, first = [], 1
    for length in lengths:
        documents.append(list(range(first, first + length)))
        first += length
    return documents


def segments(row):
    """The row cut where its positions restart: [(tokens, positions, labels)], padding included."""
    starts = (row["position_ids"] == 0).nonzero().flatten().tolist() + [len(row["input_ids"])]
    return [tuple(row[key][a:b].tolist() for key in ("input_ids", "position_ids", "labels"))
            for a, b in zip(starts, starts[1:])]


def skewed_lengths(count, seed=0):
    """Lognormal document lengths, a few longer than a row."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.empty(count).log_normal_(1.5, 0.9, generator=generator)
    return [max(1, min(int(length), 3 * ROW)) for length in lengths]


@pytest.mark.parametrize("open_rows", [1, 4])
def test_every_token_of_every_document_is_in_exactly_one_row_once(open_rows):
    lengths = skewed_lengths(60)
    assert max(lengths) > ROW, "the test needs documents longer than a row"
    documents = numbered_documents(lengths)
    rows = list(pack_documents(documents, ROW, pad_id=0, open_rows=open_rows))

    assert all(row[key].shape == (ROW,) and row[key].dtype == torch.int64 for row in rows for key in row)
    tokens = [t for row in rows for t in row["input_ids"].tolist() if t != 0]
    assert sorted(tokens) == list(range(1, sum(lengths) + 1))  # each once, none lost, none made up
    for row in rows:
        for ids, positions, _ in segments(row):
            assert positions == list(range(len(ids)))
            # A segment is one document's run of tokens (or padding): consecutive numbers, or all 0.
            assert ids == list(range(ids[0], ids[0] + len(ids))) or set(ids) == {0}
    # Whole rows: no more rows than the tokens need, bar the open rows' slack.
    assert len(rows) * ROW - sum(lengths) < ROW * (len(rows) + 1) // 2


def test_sequential_packing_keeps_the_documents_in_order_and_cuts_long_ones_into_row_sized_pieces():
    documents = numbered_documents([3, 2, 1, 20, 5])
    rows = list(pack_documents(documents, ROW, open_rows=1))

    assert [[s[0] for s in segments(row)] for row in rows] == [
        [[1, 2, 3], [4, 5], [6], [0] * 10],          # the 20-token document does not fit: the row is padded
        [list(range(7, 23))],                        # its first 16 tokens fill a row on their own
        [[23, 24, 25, 26], list(range(27, 32)), [0] * 7],  # its last 4 are a document of their own
    ]


def test_labels_are_the_tokens_with_every_document_start_and_the_padding_left_out():
    row, = pack_documents([[11, 12, 13], [14, 15], [16]], 8)

    assert row["input_ids"].tolist() == [11, 12, 13, 14, 15, 16, 0, 0]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    # Shifted by the model, position t is scored on labels[t + 1]: 11->12, 12->13, 14->15; never 13->14
    # (across documents), 15->16, 16->pad or pad->pad.
    assert row["labels"].tolist() == [-100, 12, 13, -100, 15, -100, -100, -100]


def test_first_fit_fills_an_earlier_row_that_sequential_packing_has_closed():
    documents = [[1] * 5, [2] * 5, [3] * 3]
    sequential = [row["input_ids"].tolist() for row in pack_documents(documents, 8, open_rows=1)]
    first_fit = [row["input_ids"].tolist() for row in pack_documents(documents, 8, open_rows=2)]

    assert sequential == [[1] * 5 + [0] * 3, [2] * 5 + [3] * 3]
    assert first_fit == [[1] * 5 + [3] * 3, [2] * 5 + [0] * 3]


def test_documents_may_be_tensors_or_tokenized_rows_and_empty_ones_are_skipped():
    documents = [torch.tensor([1, 2], dtype=torch.int32), {"input_ids": [3, 4, 5], "attention_mask": [1, 1, 1]}, []]
    row, = pack_documents(documents, 6)
    assert row["input_ids"].tolist() == [1, 2, 3, 4, 5, 0]


@pytest.mark.parametrize("bad, message", [
    (dict(documents=[[1, 2]], row_length=1), "row_length must be a whole number >= 2"),
    (dict(documents=[[1, 2]], row_length=8, open_rows=0), "open_rows must be a whole number >= 1"),
    (dict(documents=[[[1, 2], [3, 4]]], row_length=8), "one document per item"),
    (dict(documents=[[0.5, 1.5]], row_length=8), "integer token ids"),
    (dict(documents=[{"text": "hi"}], row_length=8), "under 'input_ids'"),
])
def test_bad_input_is_refused_saying_what_to_do(bad, message):
    with pytest.raises(ValueError, match=message):
        list(pack_documents(**bad))


class EpochDocuments(IterableDataset):
    """A stream of documents whose order follows the epoch (set_epoch), as a shuffled stream's does."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        documents = numbered_documents([5, 9, 4, 7, 6])
        return iter(documents[self.epoch:] + documents[:self.epoch])


def test_a_map_style_dataset_is_packed_at_once_and_a_stream_as_it_is_read_again_every_epoch():
    documents = numbered_documents([5, 9, 4, 7, 6])
    rows = packed(documents, ROW, open_rows=1)
    stream = packed(EpochDocuments(), ROW, open_rows=1)

    assert isinstance(rows, PackedRows) and isinstance(stream, PackedStream)
    assert len(rows) == 3 and rows[1]["input_ids"][:2].tolist() == [15, 16]
    first = [row["input_ids"].tolist() for row in stream]
    assert first == [row["input_ids"].tolist() for row in rows]
    assert first == [row["input_ids"].tolist() for row in stream], "a stream's rows are packed again alike"
    stream.set_epoch(1)
    assert [row["input_ids"].tolist()[:2] for row in stream] == [[6, 7], [19, 20], [1, 2]]

    opened = []
    by_function = PackedStream(lambda epoch: opened.append(epoch) or iter(documents), ROW)
    by_function.set_epoch(3)
    assert len(list(by_function)) == 3 and opened == [3]
    with pytest.raises(TypeError, match="generator object"):
        PackedStream(iter(documents), ROW)


def test_a_resumed_epoch_of_a_packed_stream_skips_the_rows_already_trained_on():
    """What the docs promise of a resume: StreamShards skips ``start`` rows, and packing the same
    stream again yields the same rows, so the rest of the epoch is the rows after them."""
    from hvdtrain.data.streaming import StreamShards

    stream = PackedStream(EpochDocuments(), 8, open_rows=2)
    stream.set_epoch(1)
    whole = [row["input_ids"].tolist() for row in stream]
    shards = StreamShards(stream, rank=0, world_size=1, batch_size=1)
    shards.set_epoch(1, start=2)
    assert len(whole) > 3 and [row["input_ids"].tolist() for row in shards] == whole[2:]


def test_the_block_causal_mask_lets_a_token_see_only_its_own_document_up_to_itself():
    mask = block_causal_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]))
    allowed = [[int(v) for v in line] for line in mask[0, 0].tolist()]
    assert mask.shape == (1, 1, 6, 6)
    assert allowed == [[1, 0, 0, 0, 0, 0],
                       [1, 1, 0, 0, 0, 0],
                       [1, 1, 1, 0, 0, 0],
                       [0, 0, 0, 1, 0, 0],
                       [0, 0, 0, 1, 1, 0],
                       [0, 0, 0, 0, 0, 1]]


# --- a packed batch trains as its documents one at a time --------------------------------------------------

VOCAB = 64


def token_documents(lengths, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (length,), generator=generator) for length in lengths]


# Three rows of 16: documents of 1 token (no target), ones that end a row exactly, padding, and a
# 20-token document cut into pieces (each piece a document of its own).
LENGTHS = [5, 3, 7, 1, 9, 20, 2]


def hugging_face_model(family, attention="sdpa"):
    transformers = pytest.importorskip("transformers")
    from tests.mpi.hf_models import tiny_config

    config = tiny_config(family)
    config.max_position_embeddings = ROW
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    assert model.config._attn_implementation == attention
    return model.to(torch.float64)


def example_model():
    torch.manual_seed(0)
    return TinyTransformerLM(VOCAB, seq_len=ROW, d_model=32, layers=2, heads=4).to(torch.float64)


def loss_and_gradients(model, loss):
    model.zero_grad()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def logits_of(model, ids):
    output = model(ids)
    return getattr(output, "logits", output)


def one_at_a_time(model, documents, row_length):
    """The reference: each piece of each document alone, the sum of its token losses over their count."""
    total, targets = 0, 0
    for document in documents:
        for piece in torch.split(document, row_length):
            logits = logits_of(model, piece.unsqueeze(0))[0]
            total = total + F.cross_entropy(logits[:-1], piece[1:], reduction="sum")
            targets += len(piece) - 1
    return loss_and_gradients(model, total / targets)


@pytest.mark.parametrize("family, attention", [("llama", "sdpa"), ("llama", "eager"), ("qwen3", "sdpa"),
                                               ("example", None)])
def test_a_packed_batch_has_the_loss_and_gradients_of_its_documents_one_at_a_time(family, attention):
    model = example_model() if family == "example" else hugging_face_model(family, attention)
    documents = token_documents(LENGTHS)
    rows = list(pack_documents(documents, ROW, open_rows=2))
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    assert len(rows) == 3 and batch["input_ids"][-1, -1] == 0, "several documents per row, and padding"

    with float64_throughout():  # transformers' float32 steps (RMSNorm, softmax) would round at 1e-7
        packed_loss, packed_gradients = loss_and_gradients(model, packed_lm_step(model, batch)[0])
        loss, gradients = one_at_a_time(model, documents, ROW)

    # The same float64 sums in another order (one row against pieces alone; SDPA's masked softmax
    # against a shorter one): rounding differences of ~1e-16 relative, summed over a few hundred
    # terms; a document that saw another's tokens would be off by ~1e-3.
    assert abs(float(packed_loss - loss)) < 1e-12
    assert max(float((a - b).abs().max()) for a, b in zip(packed_gradients, gradients)) < 1e-12


def test_a_hugging_face_model_with_its_cache_on_lets_packed_documents_see_each_other():
    """Why packed_lm_step passes use_cache=False: transformers detects packing only without a cache,
    and its configs' use_cache=True makes one even in training."""
    model = hugging_face_model("llama")
    rows = list(pack_documents(token_documents(LENGTHS), ROW, open_rows=2))
    batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0]}
    assert model.training and model.config.use_cache
    with float64_throughout(), torch.no_grad():
        with_cache = model(**batch).loss
        without = packed_lm_step(model, batch)[0]
    assert abs(float(with_cache - without)) > 1e-6

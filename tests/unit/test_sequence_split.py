"""Sequence parallelism's pieces that need no second process: how heads go over the ranks, how a
batch is cut into a rank's part (labels shifted over the whole sequence first, the loss's share),
the all-to-all's index arithmetic (simulated over S ranks), and what the settings refuse."""
import pytest
import torch

from hvdtrain.common.errors import LayoutError
from hvdtrain.config.train import TrainConfig
from hvdtrain.parallel.sequence import exchange
from hvdtrain.parallel.sequence.attention import HeadSplit, head_split
from hvdtrain.parallel.sequence.batches import BatchSplitter, split_step, token_offset
from hvdtrain.parallel.sequence.groups import check_divides


class Group:
    def __init__(self, size, index):
        self.size, self.index, self.process_set = size, index, None


@pytest.mark.parametrize("heads,kv_heads,size,expected", [
    (8, 8, 2, HeadSplit(1, 1)),   # multi-head: every rank 4 query and 4 key/value heads
    (8, 2, 2, HeadSplit(1, 4)),   # grouped-query, key/value heads divide
    (8, 2, 4, HeadSplit(2, 2)),   # fewer key/value heads than ranks: each replicated twice
    (8, 1, 4, HeadSplit(4, 2)),   # multi-query
])
def test_heads_split_or_replicate(heads, kv_heads, size, expected):
    assert head_split(heads, kv_heads, size) == expected


@pytest.mark.parametrize("heads,kv_heads,size,message", [
    (6, 6, 4, "6 query heads, not a multiple of 4"),
    (12, 6, 4, "cannot split the model's 6 key/value heads"),
    (8, 3, 2, "3 key/value heads for 8 query heads"),
])
def test_heads_that_cannot_split_are_refused_by_name(heads, kv_heads, size, message):
    with pytest.raises(LayoutError, match=message):
        head_split(heads, kv_heads, size)


def test_a_tokenized_batch_is_cut_with_labels_shifted_over_the_whole_sequence():
    ids = torch.arange(16).reshape(2, 8)
    labels = ids.clone()
    labels[1, 6:] = -100  # padding: ignored targets
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 6:] = 0
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    parts = [BatchSplitter(Group(2, index)).split(batch) for index in range(2)]
    (first, scale), (second, _) = parts
    assert scale == 2.0
    assert first["input_ids"].tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert second["position_ids"].tolist() == [[4, 5, 6, 7], [4, 5, 6, 7]]
    # A part's last target is the next part's first token; the sequence's last has none.
    assert first["shift_labels"].tolist() == [[1, 2, 3, 4], [9, 10, 11, 12]]
    assert second["shift_labels"].tolist() == [[5, 6, 7, -100], [13, -100, -100, -100]]
    # The whole batch's count of targets (7 + 5), on every rank: its loss sums its part over it.
    assert int(first["num_items_in_batch"]) == int(second["num_items_in_batch"]) == 12
    assert "attention_mask" not in first
    splitter = BatchSplitter(Group(2, 1))
    splitter.split(batch)
    assert splitter.length == 8 and torch.equal(splitter.padding_mask, mask)


def test_a_pair_batch_scales_each_part_to_its_share_of_the_counted_targets():
    inputs = torch.arange(8).reshape(1, 8)
    targets = torch.arange(1, 9).reshape(1, 8)
    targets[0, 5:] = -100  # 5 counted targets: 4 in part 0, 1 in part 1
    (_, first), (_, second) = (BatchSplitter(Group(2, i)).split((inputs, targets)) for i in range(2))
    assert first == pytest.approx(2 * 4 / 5) and second == pytest.approx(2 * 1 / 5)


def test_the_step_sees_its_part_and_its_offset():
    seen = []

    def step(model, batch):
        seen.append((batch[0].tolist(), token_offset()))
        return torch.tensor(1.0), {}

    loss, _ = split_step(step, BatchSplitter(Group(4, 2)))(None, (torch.arange(8).reshape(1, 8),) * 2)
    assert seen == [([[4, 5]], 4)] and loss.item() == 1.0 and token_offset() == 0


@pytest.mark.parametrize("batch,message", [
    ({"input_ids": torch.zeros(2, 7, dtype=torch.long)}, "has 7 tokens: pad or cut sequences to a multiple of 2"),
    ({"input_ids": torch.zeros(1, 4, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 0, 1]])},
     "for a Hugging Face model only"),
    (torch.zeros(2, 4), "cuts batches of token sequences"),
])
def test_batches_that_cannot_be_cut_are_refused_by_name(batch, message):
    with pytest.raises(LayoutError, match=message):
        BatchSplitter(Group(2, 0)).split(batch)


def test_the_exchange_gives_each_rank_whole_sequences_of_its_heads_and_back(monkeypatch):
    """The all-to-alls' index arithmetic over S simulated ranks: Horovod's alltoall sends part j of
    dim 0 to rank j; here every rank's call is collected and answered as it would be."""
    size, batch, heads, length, dim = 4, 2, 8, 12, 3
    whole = torch.randn(batch, heads, length, dim, dtype=torch.float64)
    own = [whole[:, :, r * length // size:(r + 1) * length // size] for r in range(size)]

    def simulate(transform, inputs):
        sent = []
        monkeypatch.setattr(exchange, "_alltoall", lambda x, ps, name: sent.append(x) or x)
        for x in inputs:
            transform(x, size, None, "t")
        received = [torch.stack([sent[j][r] for j in range(size)]) for r in range(size)]
        outputs = iter(received)
        monkeypatch.setattr(exchange, "_alltoall", lambda x, ps, name: next(outputs))
        return [transform(x, size, None, "t") for x in inputs]

    gathered = simulate(exchange._heads_out, own)
    for rank, part in enumerate(gathered):
        assert torch.equal(part, whole[:, rank * heads // size:(rank + 1) * heads // size])
    back = simulate(exchange._heads_in, gathered)
    for rank, part in enumerate(back):
        assert torch.equal(part, own[rank])


@pytest.mark.parametrize("settings,message", [
    (dict(sequence_parallel=2, pipeline_parallel=2), "pipeline_parallel=2"),
    (dict(sequence_parallel=2, reduction="adasum"), "reduction=adasum"),
    (dict(sequence_parallel=2, strategy="ps"), "strategy=ps"),
    (dict(sequence_parallel=2, expert_parallel=2), "load-balancing loss"),
    (dict(sequence_parallel=2, compile=True), "compile"),
    (dict(sequence_parallel=0), "sequence_parallel"),
])
def test_settings_sequence_parallelism_cannot_serve_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings)


def test_groups_must_divide_the_world():
    check_divides(4, 2)
    with pytest.raises(LayoutError, match="run a multiple of 4 workers"):
        check_divides(6, 4)


def test_sequence_groups_inside_tensor_groups_hold_one_tensor_index_and_neighbouring_data():
    """rank = d·T + t: a sequence group is S consecutive data coordinates of one tensor index, so a
    tensor group's ranks hold the same tokens, and the mesh's data group (every d of one t) contains
    whole sequence groups."""
    from hvdtrain.parallel.mesh import MeshShape
    from hvdtrain.parallel.sequence.groups import group_ranks

    assert group_ranks(4, 2) == [(0, 1), (2, 3)]  # no tensor parallelism: consecutive ranks
    groups = group_ranks(8, 2, tensor=2)
    assert groups == [(0, 2), (1, 3), (4, 6), (5, 7)]
    shape = MeshShape.for_world(8, tensor=2)
    for ranks in groups:
        assert len({shape.coordinates(r).tensor for r in ranks}) == 1
        assert set(ranks) <= set(shape.data_group(ranks[0]))
    assert sorted(r for ranks in groups for r in ranks) == list(range(8))
    with pytest.raises(LayoutError, match="tensor_parallel=2 = 4 ranks"):
        group_ranks(6, 2, tensor=2)

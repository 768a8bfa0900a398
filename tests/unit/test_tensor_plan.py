"""Tensor-parallel pieces that need no other process: TensorShard's slices, plans and their errors,
and the split layers' shapes (a group of 2 ranks that never communicates: only built, never run)."""
import pytest
import torch
from torch import nn

from hvdtrain.examples.textlm import TinyTransformerLM
from hvdtrain.examples.textlm_parallel import check_tensor_parallel, parallelize_tensor, tensor_plan
from hvdtrain.parallel.mesh import Group
from hvdtrain.parallel.tensor.layers import ColumnParallelLinear, ParallelSelfAttention, RowParallelLinear, TensorShard
from hvdtrain.parallel.tensor.plan import check_plan, parallelize


def model(d_model=32, heads=4, layers=2, dropout=0.0, seed=0):
    torch.manual_seed(seed)
    return TinyTransformerLM(20, seq_len=16, d_model=d_model, layers=layers, heads=heads, dropout=dropout).double()


def pair(index=0):
    """Rank ``index`` of a tensor group of two (no process set: nothing here communicates)."""
    return Group((0, 1), index, None)


@pytest.mark.parametrize("parts", [1, 2, 4])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("dim", [0, 1])
def test_every_part_placed_rebuilds_the_full_tensor(dim, groups, parts):
    shape = [5, 5]
    shape[dim] = 24
    full = torch.randn(*shape, dtype=torch.float64)
    rebuilt = torch.zeros_like(full)
    covered = torch.zeros_like(full)
    for index in range(parts):
        shard = TensorShard(dim=dim, parts=parts, index=index, groups=groups)
        local = shard.take(full)
        assert local.shape == shard.local_shape(full.shape) and local.shape[dim] == 24 // parts
        shard.place(rebuilt, local)
        shard.place(covered, shard.take(covered) + 1)
    assert torch.equal(rebuilt, full)
    assert torch.equal(covered, torch.ones_like(full))  # each element placed exactly once


def test_three_groups_take_the_same_heads_of_q_k_and_v():
    width = 8  # 4 heads of 2
    qkv = torch.arange(3 * width * 2, dtype=torch.float64).reshape(3 * width, 2)
    q, k, v = qkv.chunk(3)
    local = TensorShard(dim=0, parts=2, index=1, groups=3).take(qkv)
    # rank 1 of 2 holds heads 2 and 3: rows 4..7 of each of q, k, v
    assert torch.equal(local, torch.cat([q[4:], k[4:], v[4:]]))
    bias = torch.arange(3 * width, dtype=torch.float64)
    assert TensorShard(dim=0, parts=2, index=0, groups=3).take(bias).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]


def test_a_shard_refuses_what_does_not_split():
    with pytest.raises(ValueError, match="index"):
        TensorShard(dim=0, parts=2, index=2)
    with pytest.raises(ValueError, match="does not split into 3 groups x 2 parts"):
        TensorShard(dim=0, parts=2, index=0, groups=3).take(torch.zeros(9, 2))
    with pytest.raises(ValueError, match="not a slice"):
        TensorShard(dim=1, parts=2, index=0).place(torch.zeros(4, 4), torch.zeros(4, 3))


def test_split_layers_hold_their_slices_with_the_full_names_and_dtype():
    torch.manual_seed(0)
    linear = nn.Linear(6, 8).double()
    column = ColumnParallelLinear.from_linear(linear, pair(1), name="up")
    row = RowParallelLinear.from_linear(linear, pair(1), name="down")
    assert torch.equal(column.weight, linear.weight[4:]) and torch.equal(column.bias, linear.bias[4:])
    assert torch.equal(row.weight, linear.weight[:, 3:]) and torch.equal(row.bias, linear.bias)
    assert column.weight.dtype == torch.float64 and column.weight.tensor_shard == TensorShard(0, 2, 1)
    assert row.weight.tensor_shard == TensorShard(1, 2, 1) and not hasattr(row.bias, "tensor_shard")
    assert list(column.state_dict()) == list(row.state_dict()) == list(linear.state_dict())


def test_the_textlm_plan_splits_every_block_and_keeps_the_state_dict_keys():
    full = model()
    split = parallelize_tensor(model(), pair(0))
    assert tensor_plan(full) == {"blocks.0.attention": "attention", "blocks.0.mlp.0": "colwise",
                                 "blocks.0.mlp.2": "rowwise", "blocks.1.attention": "attention",
                                 "blocks.1.mlp.0": "colwise", "blocks.1.mlp.2": "rowwise"}
    assert list(split.state_dict()) == list(full.state_dict())
    attention = split.blocks[1].attention
    assert isinstance(attention, ParallelSelfAttention) and attention.heads == 2
    assert attention.qkv.weight.shape == (48, 32) and attention.proj.weight.shape == (32, 16)
    assert attention.qkv.weight.tensor_shard == TensorShard(0, 2, 0, groups=3)
    assert split.blocks[0].mlp[0].weight.shape == (64, 32) and split.blocks[0].mlp[2].weight.shape == (32, 64)
    sharded = {n for n, p in split.named_parameters() if hasattr(p, "tensor_shard")}
    assert sharded == {f"blocks.{b}.{layer}" for b in range(2) for layer in (
        "attention.qkv.weight", "attention.qkv.bias", "attention.proj.weight", "mlp.0.weight", "mlp.0.bias",
        "mlp.2.weight")}
    assert split.head.weight is split.token.weight  # still tied, replicated


def test_one_rank_computes_the_full_model():
    full = model()
    split = parallelize(model(), {"blocks.*.attention": "attention", "blocks.*.mlp.0": "column",
                                  "blocks.*.mlp.2": "row"}, None)
    ids = torch.randint(0, 20, (3, 16), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(split(ids), full(ids), atol=1e-12, rtol=0)
    for (name, ours), theirs in zip(split.named_parameters(), full.parameters()):
        assert torch.equal(ours, theirs), name


@pytest.mark.parametrize("plan, size, message", [
    ({"blocks.0.attention": "attention"}, 2, "blocks.0.attention has heads=3, not divisible by tensor_parallel=2"),
    ({"blocks.*.mlp.9": "colwise"}, 2, "'blocks.*.mlp.9' matches no module of TinyTransformerLM"),
    ({"blocks.0.norm1": "colwise"}, 2, "blocks.0.norm1 is LayerNorm, but style 'colwise' splits an nn.Linear"),
    ({"blocks.1.mlp.0": "attention"}, 1, "blocks.1.mlp.0 is Linear, but style 'attention'"),
    ({"blocks.0.mlp.0": "diagonal"}, 2, "blocks.0.mlp.0: style 'diagonal' is not supported"),
    ({"blocks.0.mlp.0": "colwise", "blocks.*.mlp.0": "rowwise"}, 2, "blocks.0.mlp.0 is given two styles"),
    ({"blocks.0.attention": "attention", "blocks.0.attention.qkv": "colwise"}, 3, "blocks.0.attention .* contains"),
    ({"blocks.0.mlp.0": "colwise"}, 5, "blocks.0.mlp.0 \\(colwise\\) has out_features=24, not divisible by tensor_parallel=5"),
    ({"blocks.0.mlp.2": "rowwise"}, 5, "blocks.0.mlp.2 \\(rowwise\\) has in_features=24, not divisible by tensor_parallel=5"),
])
def test_a_plan_that_cannot_split_names_the_layer(plan, size, message):
    with pytest.raises(ValueError, match=message):
        check_plan(model(d_model=6, heads=3), plan, size)


def test_a_refused_plan_leaves_the_model_unchanged():
    subject = model(d_model=6, heads=3)
    before = {name: type(m) for name, m in subject.named_modules()}
    with pytest.raises(ValueError, match="blocks.0.attention has heads=3"):
        parallelize(subject, {"blocks.*.mlp.0": "colwise", "blocks.*.mlp.2": "rowwise",
                              "blocks.*.attention": "attention"}, pair())
    assert {name: type(m) for name, m in subject.named_modules()} == before
    assert not any(hasattr(p, "tensor_shard") for p in subject.parameters())


def test_textlm_checks_say_what_to_change():
    with pytest.raises(ValueError, match="blocks.0.attention has heads=4, not divisible by tensor_parallel=3"):
        check_tensor_parallel(model(d_model=36, heads=4), 3)
    with pytest.raises(ValueError, match="needs model.dropout=0"):
        check_tensor_parallel(model(dropout=0.1), 2)
    check_tensor_parallel(model(dropout=0.1), 1)
    with pytest.raises(TypeError, match="TinyTransformerLM's plan"):
        tensor_plan(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="an already split"):
        parallelize_tensor(parallelize_tensor(model(), pair()), pair())

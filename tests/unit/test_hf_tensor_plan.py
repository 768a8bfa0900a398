"""Hugging Face's tensor-parallel plans read by hvdtrain without another process: which layers they
split and how, and the plans or models refused by name (a group of 2 ranks that never communicates:
the split layers are only built)."""
import pytest
import torch
from torch import nn

from hvdtrain.parallel.mesh import Group
from hvdtrain.parallel.tensor.layers import (GatheredColumnParallelLinear, SplitInputRowParallelLinear,
                                      VocabParallelEmbedding)
from hvdtrain.parallel.tensor.plan import STYLES, check_plan, model_tensor_plan, parallelize

transformers = pytest.importorskip("transformers")


def llama(kv_heads=2, tied=True):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config)


def pair(index=0):
    return Group((0, 1), index, None)


def test_the_models_own_plan_splits_projections_embedding_and_head():
    model = llama()
    chosen = dict(check_plan(model, model_tensor_plan(model), 2))
    assert chosen["model.layers.1.self_attn.k_proj"] == "colwise"
    assert chosen["model.layers.0.mlp.down_proj"] == "rowwise"
    assert chosen["lm_head"] == "colwise_gather_output"
    assert chosen["model.embed_tokens"] == "embedding_rowwise"


def test_the_base_models_plan_is_found_under_its_prefix():
    model = llama()
    chosen = check_plan(model, model.config.base_model_tp_plan, 2)  # keys like layers.*.self_attn.q_proj
    assert ("model.layers.0.self_attn.q_proj", "colwise") in chosen and len(chosen) == 2 * 7


def test_a_split_model_keeps_its_state_dict_keys_local_shapes_and_its_tie():
    model = llama()
    keys = list(model.state_dict())
    parallelize(model, model_tensor_plan(model), pair(1))
    assert list(model.state_dict()) == keys
    assert isinstance(model.lm_head, GatheredColumnParallelLinear)
    assert isinstance(model.model.embed_tokens, VocabParallelEmbedding)
    assert model.model.embed_tokens.start == 32 and model.model.embed_tokens.weight.shape == (32, 32)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # one parameter, cut once
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (8, 32)  # 1 of 2 key/value heads of 8
    assert model.model.layers[0].self_attn.o_proj.weight.shape == (32, 16)  # 2 of 4 query heads


def test_grouped_query_attention_refuses_a_size_that_cuts_a_key_value_head():
    with pytest.raises(ValueError, match=r"k_proj holds 2 heads of 8 \(LlamaAttention\); tensor_parallel=4 would "
                                         r"cut a head. Choose a tensor_parallel that divides 2"):
        check_plan(llama(kv_heads=2), model_tensor_plan(llama()), 4)
    assert check_plan(llama(kv_heads=4), model_tensor_plan(llama(kv_heads=4)), 4)


def test_a_style_hvdtrain_does_not_implement_is_refused_with_the_ones_it_does():
    with pytest.raises(ValueError, match="style 'grouped_gemm' is not supported; hvdtrain splits by colwise, "
                                         "colwise_gather_output, packed_colwise, rowwise"):
        check_plan(llama(), {"model.layers.*.mlp.gate_proj": "grouped_gemm"}, 2)
    assert "replicated_with_grad_allreduce" in STYLES and "embedding_rowwise" in STYLES


def test_transformers_4_style_names_are_the_same_layers_as_their_5_names():
    """colwise_rep and rowwise_rep (transformers 4.x's names) build what colwise_gather_output and
    rowwise_split_input build: one rank's slices, the output whole."""
    def split(head_style, down_style):
        model = llama(tied=False)
        plan = {"lm_head": head_style, "model.layers.*.mlp.down_proj": down_style}
        chosen = dict(check_plan(model, plan, 2))
        parallelize(model, plan, pair(1))
        return chosen, model

    old_chosen, old = split("colwise_rep", "rowwise_rep")
    new_chosen, new = split("colwise_gather_output", "rowwise_split_input")
    assert old_chosen == new_chosen and old_chosen["lm_head"] == "colwise_gather_output"
    assert old_chosen["model.layers.0.mlp.down_proj"] == "rowwise_split_input"
    assert type(old.lm_head) is type(new.lm_head) is GatheredColumnParallelLinear
    down = (old.model.layers[1].mlp.down_proj, new.model.layers[1].mlp.down_proj)
    assert type(down[0]) is type(down[1]) is SplitInputRowParallelLinear
    assert torch.equal(old.lm_head.weight, new.lm_head.weight) and old.lm_head.weight.shape == (32, 32)


def test_a_tie_cut_on_one_side_only_is_refused():
    with pytest.raises(ValueError, match="lm_head.weight is tied to model.embed_tokens.weight, and the plan keeps "
                                         "it whole"):
        check_plan(llama(tied=True), {"lm_head": "colwise_gather_output"}, 2)
    assert check_plan(llama(tied=False), {"lm_head": "colwise_gather_output"}, 2) == [("lm_head", "colwise_gather_output")]


def test_a_packed_projection_is_cut_in_each_of_its_halves():
    torch.manual_seed(0)
    fused = nn.Sequential(nn.Linear(4, 8, bias=False))
    whole = fused[0].weight.detach().clone()
    parallelize(fused, {"0": "packed_colwise"}, pair(1))
    # [gate; up] of 4 rows each: rank 1 holds rows 2-3 of gate and rows 2-3 of up.
    assert torch.equal(fused[0].weight, torch.cat([whole[2:4], whole[6:8]]))
    with pytest.raises(ValueError, match=r"out_features=6, not divisible by tensor_parallel=2 x 2 packed"):
        check_plan(nn.Sequential(nn.Linear(4, 6)), {"0": "packed_colwise"}, 2)


def test_one_rank_computes_the_whole_model_with_its_plan():
    """A group of one: every split layer holds everything and communicates nothing; the logits are
    the model's own."""
    model = llama().double()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    parallelize(model, model_tensor_plan(model), None)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert torch.equal(before, after)


class _DoubledLookup(nn.Embedding):
    """Reads its own table: a split layer beneath it would not see what it does."""

    def forward(self, ids):
        return torch.nn.functional.embedding(ids, self.weight) * 2


class _ScaledLookup(nn.Embedding):
    """Wraps nn.Embedding's forward, as Gemma's embedding does: kept around the split lookup."""

    def forward(self, ids):
        return super().forward(ids) * torch.tensor(3.0, dtype=self.weight.dtype)


class _ClampedLinear(nn.Linear):
    def forward(self, x):
        return super().forward(x).clamp(-1, 1)


def test_an_embedding_with_its_own_forward_keeps_it_around_the_split_lookup(monkeypatch):
    # No other rank here: the lookup's sum over the group is this rank's part, enough for ids it holds.
    monkeypatch.setattr("hvdtrain.parallel.tensor.layers.reduce_from_tensor_group", lambda x, group, name: x)
    model = llama(tied=False)
    whole = _ScaledLookup(64, 32)
    model.model.embed_tokens = whole
    parallelize(model, model_tensor_plan(model), pair(1))
    split = model.model.embed_tokens
    assert isinstance(split, _ScaledLookup) and isinstance(split, VocabParallelEmbedding)
    assert type(split).__name__ == "VocabParallel_ScaledLookup" and split.weight.shape == (32, 32)
    ids = torch.tensor([[40, 63]])  # rows of rank 1: the lookup needs no other rank's part
    assert torch.equal(split(ids), whole(ids))


@pytest.mark.parametrize("layer,path,reason", [
    (lambda: _DoubledLookup(64, 32), "model.embed_tokens",
     r"_DoubledLookup.forward computes with torch.nn.functional.embedding itself"),
    (lambda: _ClampedLinear(32, 32, bias=False), "model.layers.0.self_attn.q_proj",
     r"an nn.Linear with a forward of its own"),
])
def test_a_layer_whose_forward_a_split_would_drop_is_refused_by_name(layer, path, reason):
    model = llama(tied=False)
    parent_path, _, child = path.rpartition(".")
    setattr(model.get_submodule(parent_path), child, layer())
    with pytest.raises(ValueError, match=rf"tensor plan: {path} is a _\w+, .*{reason}.*Leave {path} out of the plan"):
        check_plan(model, model_tensor_plan(model), 2)


class _LatentAttention(nn.Module):
    """DeepSeek-V2's shape: one whole projection into [latent (16); rotary key (qk_rope_head_dim)]."""

    def __init__(self, rope=None):
        super().__init__()
        self.kv_a_proj_with_mqa = nn.Linear(32, 16 + 8)
        if rope is not None:
            self.qk_rope_head_dim = rope


def test_mla_kv_a_proj_keeps_the_projection_whole_and_reads_the_rotary_width():
    model = nn.Module()
    model.attn = _LatentAttention(rope=8)
    before = model.attn.kv_a_proj_with_mqa.weight.clone()
    x = torch.randn(2, 3, 32)
    expected = model.attn.kv_a_proj_with_mqa(x)
    parallelize(model, {"attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}, None)
    assert isinstance(model.attn.kv_a_proj_with_mqa, nn.Linear)  # not replaced: its parameter names stay
    assert torch.equal(model.attn.kv_a_proj_with_mqa.weight, before)
    assert torch.equal(model.attn.kv_a_proj_with_mqa(x), expected)  # the forward is unchanged
    with pytest.raises(ValueError, match="parallelize once"):
        check_plan(model, {"attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}, 2)


def test_mla_kv_a_proj_without_a_rotary_width_is_refused_by_name():
    model = nn.Module()
    model.attn = _LatentAttention()
    with pytest.raises(ValueError, match=r"attn.kv_a_proj_with_mqa \(mla_kv_a_proj\).*qk_rope_head_dim"):
        check_plan(model, {"attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}, 2)
    model.attn.qk_rope_head_dim = 24  # the whole output: no latent left
    with pytest.raises(ValueError, match="does not hold a latent"):
        check_plan(model, {"attn.kv_a_proj_with_mqa": "mla_kv_a_proj"}, 2)


def test_mla_kv_a_proj_sums_only_the_rotary_keys_gradient():
    """Two ranks simulated by their gradient sum: the hook sums the rotary part, not the latent."""
    from hvdtrain.parallel.tensor import mla as tensor_mla

    calls = []
    model = nn.Module()
    model.attn = _LatentAttention(rope=8)
    original = tensor_mla.copy_to_tensor_group

    def recording(x, group, name):
        calls.append((tuple(x.shape), name))
        return original(x, group, name)

    tensor_mla.copy_to_tensor_group = recording
    try:
        tensor_mla.sum_rotary_key_gradient(model.attn.kv_a_proj_with_mqa, model, model.attn, None, "attn.kv")
        model.attn.kv_a_proj_with_mqa(torch.randn(2, 3, 32))
    finally:
        tensor_mla.copy_to_tensor_group = original
    assert calls == [((2, 3, 8), "tp.mla.attn.kv")]


class _SinkAttention(nn.Module):
    """gpt-oss-style attention: per-head sinks, a bare parameter its own forward reads."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(32, 32)
        self.sinks = nn.Parameter(torch.arange(4, dtype=torch.float32))


def test_local_params_cuts_a_per_head_vector_by_its_own_entry_and_keeps_its_owner():
    model = nn.Module()
    model.attn = _SinkAttention()
    plan = {"attn.q_proj": "colwise", "attn.sinks": "colwise", "attn": "local_params"}
    assert check_plan(model, plan, 2) == [("attn", "local_params"), ("attn.q_proj", "colwise")]
    parallelize(model, plan, Group((0, 1), 1, None))
    assert model.attn.sinks.tolist() == [2.0, 3.0] and model.attn.sinks.tensor_shard.dim == 0
    assert set(dict(model.named_parameters())) == {"attn.q_proj.weight", "attn.q_proj.bias", "attn.sinks"}


def test_a_bare_parameter_outside_local_params_or_not_a_vector_is_refused_by_name():
    model = nn.Module()
    model.attn = _SinkAttention()
    with pytest.raises(ValueError, match="attn.sinks.*not in the plan"):
        check_plan(model, {"attn.sinks": "colwise"}, 2)
    with pytest.raises(ValueError, match="as 'rowwise'"):
        check_plan(model, {"attn.sinks": "rowwise", "attn": "local_params"}, 2)
    model.attn.sinks = nn.Parameter(torch.zeros(4, 2))
    with pytest.raises(ValueError, match=r"shape \(4, 2\).*only 1-D"):
        check_plan(model, {"attn.sinks": "colwise", "attn": "local_params"}, 2)
    model.attn.sinks = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="3 entries, not divisible"):
        check_plan(model, {"attn.sinks": "colwise", "attn": "local_params"}, 2)


def test_replicate_keeps_a_module_whole_as_if_the_plan_did_not_name_it():
    """transformers' "replicate" (Inkling2's embedding): every rank keeps the whole module."""
    model = llama(tied=False)
    plan = {**model_tensor_plan(model), "model.embed_tokens": "replicate"}
    chosen = dict(check_plan(model, plan, 2))
    assert "model.embed_tokens" not in chosen and chosen["lm_head"] == "colwise_gather_output"


def test_an_entry_of_the_familys_own_plan_naming_nothing_here_is_skipped_whatever_its_style(monkeypatch):
    """Qwen4-Exp's plan cuts per-layer embeddings some configurations lack ('embedding_colwise', a style
    hvdtrain does not implement): with no such layer, nothing would be cut. The same style on a layer
    the model has, or in a plan of one's own, is still refused."""
    model = llama()
    own = {**model_tensor_plan(model), "model.layers.*.ple.embedding": "embedding_colwise"}
    monkeypatch.setattr("hvdtrain.parallel.tensor.plan.model_tensor_plan", lambda _: own)
    assert dict(check_plan(model, own, 2))["model.embed_tokens"] == "embedding_rowwise"
    with pytest.raises(ValueError, match="embedding_colwise"):
        check_plan(model, {**own, "model.embed_tokens": "embedding_colwise"}, 2)
    monkeypatch.undo()  # the model's own plan without the entry: the user's plan names it
    with pytest.raises(ValueError, match="embedding_colwise"):
        check_plan(model, {"model.layers.*.ple.embedding": "embedding_colwise"}, 2)


def test_a_gathered_layer_says_the_whole_width_it_outputs_and_a_split_input_one_the_whole_it_takes():
    """A model may read a split layer's widths: Apertus 1.5's loss views its logits by
    ``lm_head.out_features``, and under T=2 the local width cut every row of logits in two (a
    cross-entropy over twice the rows, refused by transformers as a batch mismatch)."""
    head, down = nn.Linear(8, 6), nn.Linear(6, 4)
    gathered = GatheredColumnParallelLinear.from_linear(head, Group((0, 1), 1, None), name="head")
    split_input = SplitInputRowParallelLinear.from_linear(down, Group((0, 1), 1, None), name="down")
    assert tuple(gathered.weight.shape) == (3, 8) and gathered.out_features == 6 and gathered.in_features == 8
    assert tuple(split_input.weight.shape) == (4, 3) and split_input.in_features == 6 and split_input.out_features == 4

"""transformers' packed_rowwise, moe_identity_expert and all_reduce read by hvdtrain without another
process: the families that use them (Aria and Llama 4's transposed experts, LongCat-Flash's identity
experts, Inkling's shared experts) built tiny as ``hvdtrain check-layout`` builds them, split as rank 1
of 2 (a group that never communicates: the split layers are only built), and the plans hvdtrain
refuses by name. tests/mpi/test_hf_moe_styles.py trains them against one process."""
import copy
import functools

import pytest
import torch

from hvdtrain.parallel.mesh import Group
from hvdtrain.parallel.tensor.plan import check_plan, model_tensor_plan, parallelize

pytest.importorskip("transformers")
from hvdtrain.verify.tiny import build_tiny  # noqa: E402

RANK_1_OF_2 = Group((0, 1), 1, None)


@functools.lru_cache(maxsize=None)
def _built(model_type):
    return build_tiny(model_type)


def tiny(model_type):
    """A fresh copy of the family built tiny (built once: a split changes the model it is given)."""
    built = _built(model_type)
    assert built.built, built.reason
    return copy.deepcopy(built.model)


def experts_only(experts, gate_up, down, module="moe_tp_experts"):
    return {f"{experts}.gate_up_proj": gate_up, f"{experts}.down_proj": down, experts: module}


@pytest.mark.parametrize("model_type,experts", [("aria_text", "model.layers.0.mlp.experts"),
                                                ("llama4_text", "model.layers.0.feed_forward.experts")])
def test_transposed_experts_split_the_last_dim_of_gate_up_in_two_groups_and_the_rows_of_down(model_type, experts):
    model = tiny(model_type)
    built = model.get_submodule(experts)
    gate_up, down = built.gate_up_proj.detach().clone(), built.down_proj.detach().clone()
    assert gate_up.shape == (4, 64, 256) and down.shape == (4, 128, 64)  # (experts, in, out): intermediate 128
    parallelize(model, model_tensor_plan(model), RANK_1_OF_2)
    split = model.get_submodule(experts)
    assert type(split) is type(built) and split is not built
    # Rank 1's gate columns 64:128 and up columns 192:256 of every expert, and down's rows 64:128.
    assert torch.equal(split.gate_up_proj, torch.cat([gate_up[..., 64:128], gate_up[..., 192:256]], dim=-1))
    assert torch.equal(split.down_proj, down[:, 64:128])
    assert (split.gate_up_proj.tensor_shard.dim, split.gate_up_proj.tensor_shard.groups) == (2, 2)
    assert (split.down_proj.tensor_shard.dim, split.down_proj.tensor_shard.groups) == (1, 1)
    assert built.gate_up_proj.shape == (4, 64, 256) and not built._forward_hooks  # the module as built: unchanged


def test_experts_that_declare_no_layout_are_read_by_the_plan_and_a_misreading_is_refused_by_their_shapes():
    model = tiny("llama4_text")
    experts = "model.layers.*.feed_forward.experts"
    assert not hasattr(model.model.layers[0].feed_forward.experts, "is_transposed")
    # Read as (experts, out, in) the input projection's intermediate is 64 / 2, down_proj's 64: not one layout.
    with pytest.raises(ValueError, match=r"intermediate sizes differ \(\{'gate_up_proj': 32, 'down_proj': 64\}\) "
                                         r"read as \(experts, out, in\)"):
        check_plan(model, experts_only(experts, "packed_colwise", "rowwise"), 2)


def test_aria_declares_its_layout_and_an_entry_cutting_another_is_refused():
    experts = "model.layers.*.mlp.experts"
    with pytest.raises(ValueError, match=r"cuts model.layers.0.mlp.experts.down_proj as 'rowwise', but moe_tp_experts "
                                         r"cuts down_proj along dim 1: .* give 'colwise'"):
        check_plan(tiny("aria_text"), experts_only(experts, "packed_rowwise", "rowwise"), 2)


@pytest.mark.parametrize("plan,message", [
    (experts_only("model.layers.*.mlp.experts", "packed_rowwise", "colwise"),
     r"intermediate size of 128, not divisible by tensor_parallel=3"),
    ({"model.layers.*.mlp.shared_experts.gate_proj": "packed_rowwise"},
     r"'model.layers.\*.mlp.shared_experts.gate_proj' \(packed_rowwise\) names the module "
     r"model.layers.0.mlp.shared_experts.gate_proj: hvdtrain cuts 'packed_rowwise' only as a fused experts' parameter"),
])
def test_packed_rowwise_is_refused_where_it_cannot_cut(plan, message):
    with pytest.raises(ValueError, match=message):
        check_plan(tiny("aria_text"), plan, 3)


def test_an_identity_expert_inside_split_experts_gets_a_copy_that_divides_its_input():
    model = tiny("longcat_flash")
    built = model.model.layers[0].mlp.experts
    parallelize(model, model_tensor_plan(model), RANK_1_OF_2)
    split = model.model.layers[0].mlp.experts
    divided = split.identity_expert
    assert divided is not built.identity_expert and divided._tp_identity_divided
    assert not built.identity_expert._forward_pre_hooks  # the whole model's identity: unchanged
    assert torch.equal(divided(torch.full((3,), 4.0, dtype=torch.float64)), torch.full((3,), 2.0, dtype=torch.float64))
    assert split.gate_up_proj.shape[1] * 2 == built.gate_up_proj.shape[1]


@pytest.mark.parametrize("plan,message", [
    ({"model.layers.*.mlp.experts.identity_expert": "moe_identity_expert"},
     r"model.layers.0.mlp.experts.identity_expert \(moe_identity_expert\) divides its input .* but its owner "
     r"model.layers.0.mlp.experts is not in the plan"),
    ({"model.layers.*.mlp.router.classifier": "moe_identity_expert"}, r"its owner model.layers.0.mlp.router is not"),
])
def test_an_identity_expert_outside_split_experts_is_refused(plan, message):
    with pytest.raises(ValueError, match=message):
        check_plan(tiny("longcat_flash"), plan, 2)


SHARED = "model.layers.*.mlp.shared_experts"
INKLING_EXPERTS = experts_only("model.layers.*.mlp.experts", "packed_colwise", "rowwise")


def shared_experts_plan(**styles):
    plan = {f"{SHARED}.gate_proj": "colwise", f"{SHARED}.up_proj": "colwise", f"{SHARED}.down_proj": "rowwise",
            SHARED: "all_reduce", **INKLING_EXPERTS}
    plan.update({f"{SHARED}.{name}": style for name, style in styles.items()})
    return {key: style for key, style in plan.items() if style is not None}


def test_inklings_own_plan_is_refused_for_cutting_gate_up_apart():
    # transformers' plan cuts the experts' [gate; up] rows as plain colwise: gate on rank 0, up on rank 1.
    with pytest.raises(ValueError, match=r"cuts model.layers.0.mlp.experts.gate_up_proj as 'colwise', but "
                                         r"moe_tp_experts cuts gate_up_proj along dim 1 in 2 packed groups"):
        check_plan(tiny("inkling_text"), model_tensor_plan(tiny("inkling_text")), 2)


def test_an_all_reduce_module_holds_its_intermediate_slice_of_each_bare_parameter():
    model = tiny("inkling_text")
    built = model.model.layers[0].mlp.shared_experts
    gate, down = built.gate_proj.detach().clone(), built.down_proj.detach().clone()
    parallelize(model, shared_experts_plan(), RANK_1_OF_2)
    split = model.model.layers[0].mlp.shared_experts
    assert type(split) is type(built) and split is not built
    assert torch.equal(split.gate_proj, gate[:, 16:32]) and split.up_proj.shape == (1, 16, 64)
    assert torch.equal(split.down_proj, down[..., 16:32])
    assert [split.gate_proj.tensor_shard.dim, split.down_proj.tensor_shard.dim] == [1, 2]
    assert built.gate_proj.shape == (1, 32, 64) and not built._forward_hooks


@pytest.mark.parametrize("plan,size,message", [
    (shared_experts_plan(down_proj=None), 2, r"shared_experts \(InklingSharedExperts, all_reduce\): no entry cuts "
                                             r"down_proj; a whole parameter's contribution would be counted once per rank"),
    (shared_experts_plan(gate_proj="packed_colwise"), 2, r"shared_experts.gate_proj is cut as 'packed_colwise'; "
                                                         r"inside an all_reduce module hvdtrain cuts parameters colwise or rowwise"),
    ({k: v for k, v in shared_experts_plan().items() if k not in INKLING_EXPERTS}, 3, r"shared_experts.gate_proj \(colwise\) has 32 along dim 1, not divisible by "
                               r"tensor_parallel=3"),
    ({"model.layers.*.mlp": "all_reduce"}, 2, r"model.layers.0.mlp \(InklingMoE, all_reduce\) holds layers with "
                                              r"parameters"),
])
def test_an_all_reduce_module_the_sum_would_change_is_refused(plan, size, message):
    with pytest.raises(ValueError, match=message):
        check_plan(tiny("inkling_text"), plan, size)

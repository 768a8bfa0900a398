"""Hugging Face's mixture-of-experts plan entries read by hvdtrain without another process: fused
3-D experts split by ``moe_tp_experts`` with their parameters' own entries, and the entries or
experts refused by name (a group of 2 ranks that never communicates: the split layers are only
built; tests/mpi/test_hf_moe.py trains them against one process)."""
import pytest
import torch

from hvdtrain.parallel.mesh import Group
from hvdtrain.parallel.tensor.plan import check_plan, model_tensor_plan, parallelize

transformers = pytest.importorskip("transformers")

EXPERTS = "model.layers.*.mlp.experts"


def qwen2_moe():
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24)
    return transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")


def experts_plan(**styles):
    plan = {f"{EXPERTS}.gate_up_proj": "packed_colwise", f"{EXPERTS}.down_proj": "rowwise", EXPERTS: "moe_tp_experts"}
    plan.update({f"{EXPERTS}.{name}" if name != "module" else EXPERTS: style for name, style in styles.items()})
    return {key: style for key, style in plan.items() if style is not None}


def test_the_models_own_plan_splits_the_experts_and_keeps_routers_and_the_shared_expert_whole():
    model = qwen2_moe()
    chosen = dict(check_plan(model, model_tensor_plan(model), 2))
    assert chosen["model.layers.0.mlp.experts"] == "moe_tp_experts"
    # The router (mlp.gate), the shared expert and its gate are not in the plan; its dense-MLP entries
    # (every layer here is sparse) name nothing and are skipped, as transformers skips them.
    assert not any(".mlp.gate" in path or "shared_expert" in path for path in chosen)


def test_split_experts_keep_their_class_keys_and_hold_an_intermediate_slice_of_every_expert():
    model = qwen2_moe()
    built = model.model.layers[0].mlp.experts
    whole_gate_up, keys = built.gate_up_proj.detach().clone(), list(model.state_dict())
    parallelize(model, model_tensor_plan(model), Group((0, 1), 1, None))
    split = model.model.layers[0].mlp.experts
    assert type(split) is type(built) and split is not built and list(model.state_dict()) == keys
    assert split.gate_up_proj.shape == (4, 16, 32) and split.down_proj.shape == (4, 32, 8)
    # Rank 1's gate rows 8:16 and up rows 24:32 of every expert: [gate; up] cut alike.
    assert torch.equal(split.gate_up_proj, torch.cat([whole_gate_up[:, 8:16], whole_gate_up[:, 24:32]], dim=1))
    assert split.down_proj.tensor_shard.dim == 2 and split.gate_up_proj.tensor_shard.groups == 2
    assert built.gate_up_proj.shape == (4, 32, 32) and not built._forward_hooks  # the module as built: unchanged


@pytest.mark.parametrize("plan,message", [
    (experts_plan(down_proj="colwise"), r"cuts model.layers.0.mlp.experts.down_proj as 'colwise', but moe_tp_experts "
                                        r"cuts down_proj along dim 2: .* give 'rowwise'"),
    (experts_plan(down_proj=None), r"no entry names model.layers.0.mlp.experts.down_proj"),
    (experts_plan(module=None), r"names the parameter model.layers.0.mlp.experts.gate_up_proj, and its module "
                                r"model.layers.0.mlp.experts is not in the plan"),
    ({"model.layers.*.self_attn.q_proj.weight": "colwise"}, r"names the parameter model.layers.0.self_attn.q_proj."
                                                            r"weight, and its module .* is not in the plan"),
    # packed_rowwise cuts a transposed layout's last dim: Qwen2-MoE's experts declare (experts, out, in).
    (experts_plan(gate_up_proj="packed_rowwise"), r"cuts model.layers.0.mlp.experts.gate_up_proj as 'packed_rowwise', "
                                                  r"but moe_tp_experts cuts gate_up_proj along dim 1 in 2 packed "
                                                  r"groups: .* give 'packed_colwise'"),
    ({"model.layers.*.mlp.gate_projj": "colwise"}, r"'model.layers.\*.mlp.gate_projj' matches no module"),
])
def test_a_plan_whose_experts_entries_disagree_with_the_split_is_refused_by_name(plan, message):
    with pytest.raises(ValueError, match=message):
        check_plan(qwen2_moe(), plan, 2)


def test_experts_the_split_would_change_are_refused_by_name():
    with pytest.raises(ValueError, match=r"intermediate size of 16, not divisible by tensor_parallel=3"):
        check_plan(qwen2_moe(), experts_plan(), 3)
    model = qwen2_moe()
    model.model.layers[1].mlp.experts.has_bias = True
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.experts \(Qwen2MoeExperts, moe_tp_experts\) has biases"):
        check_plan(model, experts_plan(), 2)

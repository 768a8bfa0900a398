"""Expert parallelism without MPI: the groups' arithmetic, the refusals, and the dispatch's own
bookkeeping (pairs sorted by expert, sent, computed by the module's own forward, added back per
token) in a group of one rank, where it must give the module's own output and gradients."""
import pytest
import torch

from hvdtrain.common.capabilities import EXPERT_PARALLEL, EXPERT_PARALLEL_FSDP, STRATEGY_NAMES
from hvdtrain.config.train import TrainConfig
from hvdtrain.parallel import experts as ep
from hvdtrain.parallel.mesh import Group
from hvdtrain.strategies.registry import chosen_name

transformers = pytest.importorskip("transformers")


def qwen3_experts(experts=4, seed=0):
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(vocab_size=16, hidden_size=8, intermediate_size=12, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                                         num_experts=experts, moe_intermediate_size=8, num_experts_per_tok=2)
    config._experts_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").double()
    return model, model.model.layers[0].mlp.experts


def test_groups_are_consecutive_ranks_and_their_replicas_stride_e():
    assert [ep.expert_group_ranks(8, r, 4) for r in (0, 3, 4, 7)] == [(0, 1, 2, 3), (0, 1, 2, 3), (4, 5, 6, 7),
                                                                        (4, 5, 6, 7)]
    assert [ep.replica_group_ranks(8, r, 4) for r in (0, 1, 5)] == [(0, 4), (1, 5), (1, 5)]
    assert ep.replica_group_ranks(4, 2, 4) == (2,)


def test_refusals_name_what_does_not_divide():
    with pytest.raises(ValueError, match="expert_parallel=3 does not divide the 4 workers: .* run 3 or 6 or 9"):
        ep.check_world(4, 3)
    _, experts = qwen3_experts(experts=6)
    with pytest.raises(ValueError, match=r"experts \(Qwen3MoeExperts\) has 6 experts, not divisible by "
                                         r"train.expert_parallel=4"):
        ep.check_experts("layers.0.mlp.experts", experts, 4)
    ep.check_experts("layers.0.mlp.experts", experts, 3)


def test_the_fused_experts_are_found_and_nothing_else():
    model, experts = qwen3_experts()
    assert ep.fused_experts(model) == {"model.layers.0.mlp.experts": experts}
    assert ep.fused_experts(torch.nn.Linear(3, 3)) == {}


@pytest.mark.parametrize("settings, refused", [
    (dict(strategy="ps"), "strategy=ps: its servers step every parameter for the whole world"),
    (dict(strategy="fsdp", compile=True), "compile: the experts' all-to-all"),
    (dict(tensor_parallel=2), "tensor_parallel=2 x pipeline_parallel=1: expert parallelism does not combine"),
    (dict(compile=True), "compile: the experts' all-to-all"),
    (dict(precision="fp16"), "precision=fp16"),
    (dict(reduction="adasum"), "reduction=adasum"),
    (dict(expert_parallel=0), "expert_parallel must be a whole number >= 1"),
])
def test_settings_it_does_not_combine_with_are_refused_by_name(settings, refused):
    with pytest.raises(ValueError, match=refused.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**{"expert_parallel": 2, **settings})


def test_the_setting_chooses_the_expert_parallel_strategy_which_users_cannot_name():
    assert chosen_name(TrainConfig(expert_parallel=2)) == EXPERT_PARALLEL
    assert chosen_name(TrainConfig(expert_parallel=2, strategy="fsdp")) == EXPERT_PARALLEL_FSDP
    assert chosen_name(TrainConfig(strategy="fsdp")) == "fsdp"
    assert EXPERT_PARALLEL_FSDP not in STRATEGY_NAMES
    assert chosen_name(TrainConfig()) == "ddp"
    assert EXPERT_PARALLEL not in STRATEGY_NAMES
    with pytest.raises(ValueError):
        TrainConfig(strategy=EXPERT_PARALLEL)


@pytest.mark.parametrize("implementation, dtype, bound", [
    ("eager", torch.float64, 1e-13),
    # transformers' default kernel and batched_mm have no float64 form: float32, where the same
    # products summed in another order differ by a few float32 spacings (6e-8 relative) at most
    # (measured: bitwise), while a pair sent to the wrong expert or weighted twice is off by O(1).
    ("grouped_mm", torch.float32, 1e-6),
    ("batched_mm", torch.float32, 1e-6),
])
def test_the_dispatch_in_a_group_of_one_gives_the_modules_own_output_and_gradients(implementation, dtype, bound):
    """Pairs out of expert order, a dropped pair (transformers' sentinel index n) and an expert no
    token chose, under each experts implementation: the output and every gradient (hidden states,
    routing weights, expert weights) are the module's own."""
    _, whole = qwen3_experts()
    whole.config._experts_implementation = implementation
    whole.to(dtype)
    with torch.no_grad():  # the initializer's std of 0.02 would leave outputs near 1e-4
        for parameter in whole.parameters():
            parameter.normal_()
    groups = ep.ExpertGroups(1, Group((0,), 0, None), Group((0,), 0, None), [])
    split = ep.split_experts(whole, groups, "experts")
    hidden = torch.randn(5, 8, dtype=dtype, requires_grad=True)
    index = torch.tensor([[2, 0], [0, 2], [3, 4], [2, 3], [0, 3]])  # expert 1 unchosen; 4 is the sentinel
    # transformers' sentinel index n, which eager skips: batched_mm indexes it (an IndexError in the
    # module itself) and grouped_mm reads past its experts (garbage, even NaN): eager's case only
    sentinel = implementation == "eager"
    if not sentinel:
        index[2, 1] = 0
    weights = torch.rand(5, 2, dtype=dtype, requires_grad=True)

    def run(module):
        out = module(hidden, index, weights)
        grads = torch.autograd.grad(out.square().sum(), [hidden, weights, *module.parameters()])
        return out, grads

    expected, expected_grads = run(whole)
    got, got_grads = run(split)

    assert split.gate_up_proj is not whole.gate_up_proj and split.gate_up_proj.expert_shard.parts == 1
    relative = [((g - e).abs().max() / e.abs().max()).item() for g, e in zip((got, *got_grads),
                                                                            (expected, *expected_grads))]
    assert max(relative) < bound, relative
    # the cases are there: expert 1 chosen by no token, the dropped pair adding nothing
    assert expected_grads[2][1].abs().max() == 0 and (expected_grads[1][2, 1] == 0 or not sentinel)


def test_an_elastic_launch_is_refused_by_name():
    from hvdtrain.strategies.registry import launch_refusal

    for strategy in ("ddp", "fsdp"):
        refusal = launch_refusal(TrainConfig(expert_parallel=2, strategy=strategy), world=None, elastic=True)
        assert refusal.startswith("train.expert_parallel=2 does not support Horovod elastic (the expert groups are "
                                  "fixed"), strategy
    assert launch_refusal(TrainConfig(expert_parallel=2), world=None, elastic=False) is None

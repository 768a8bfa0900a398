"""Expert parallelism's dispatch for the families that do not call their experts as
``experts(hidden_states, top_k_index, top_k_weights)`` (JetMoe: rows sorted by expert with each
expert's count; Llama 4: every token once per expert, expert-major), in a group of one rank, where it
must give the whole model's own output and gradients; and the set-up's refusal, by name, of an experts
module called in a way the dispatch does not route. Until the dispatch told the calls apart both
families crashed in it with a raw TypeError (``_Dispatch.__call__() missing 1 required positional
argument: 'top_k_weights'``, and ``... 'top_k_index' and 'top_k_weights'``)."""
import pytest
import torch
from torch import nn

from hvdtrain.parallel import experts as ep
from hvdtrain.parallel.mesh import Group

transformers = pytest.importorskip("transformers")


def one_rank():
    return ep.ExpertGroups(1, Group((0,), 0, None), Group((0,), 0, None), [])


@pytest.mark.parametrize("family, modules, layout", [
    ("jetmoe", 8, ep.SORTED),  # two layers x (the MLP's and the attention heads' input and output maps)
    ("llama4_text", 2, ep.EXPERT_MAJOR),
])
def test_a_family_calling_its_experts_by_rows_gets_its_own_output_and_gradients(family, modules, layout):
    from hvdtrain.verify.tiny import build_tiny

    tiny = build_tiny(family)
    if not tiny.built:
        pytest.skip(f"{family} does not build tiny here: {tiny.reason}")
    model = tiny.model
    with torch.no_grad():  # the initializer's std of 0.02 would leave the experts' part near 1e-4
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(std=0.3)
    ids = torch.randint(0, tiny.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))

    def run():
        logits = model(input_ids=ids).logits
        return logits, torch.autograd.grad(logits.square().sum(), list(model.parameters()))

    expected, expected_grads = run()
    found = ep.fused_experts(model)
    assert len(found) == modules and {ep.call_layout(m) for m in found.values()} == {layout}
    for path, module in found.items():
        ep.check_experts(path, module, 2)
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, ep.split_experts(module, one_rank(), path))
    got, got_grads = run()

    assert all(type(m.forward).__name__ == "_SortedDispatch" for m in ep.fused_experts(model).values())
    assert (got - expected).abs().max() < 1e-12
    assert max((g - e).abs().max().item() for g, e in zip(got_grads, expected_grads)) < 1e-10


class ByKeyword(nn.Module):
    """Fused experts whose forward takes its routing only as keywords: the dispatch cannot route it."""

    def __init__(self):
        super().__init__()
        self.num_experts = 4
        self.gate_up_proj = nn.Parameter(torch.zeros(4, 6, 3))

    def forward(self, *inputs, **routing):
        return inputs[0]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = ByKeyword()


def test_experts_called_in_no_way_the_dispatch_routes_are_refused_at_set_up_by_name():
    from hvdtrain.strategies.experts import split_model_experts

    model = Block()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    world = type("World", (), {"size": 2, "rank": 0})()
    # refused before any collective (the broadcast, the process sets): every rank alike
    with pytest.raises(ValueError, match=r"^train.expert_parallel=2: experts \(ByKeyword\) is called as "
                                         r"forward\(\*inputs, \*\*routing\), none of the calls the all-to-all "
                                         r"dispatch routes .*; use expert_parallel=1$"):
        split_model_experts(model, optimizer, world, 2)


def test_a_routed_module_called_with_other_arguments_is_refused_by_name():
    from hvdtrain.verify.tiny import build_tiny

    tiny = build_tiny("qwen3_moe")
    path, module = next(iter(ep.fused_experts(tiny.model).items()))
    split = ep.split_experts(module, one_rank(), path)
    hidden = torch.randn(3, tiny.config.hidden_size, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"was called with a 1-D tensor \(3,\) and a 1-D tensor \(3,\) where the "
                                         r"dispatch routes \(tokens, top-k\) expert indices and weights"):
        split(hidden, torch.zeros(3, dtype=torch.int64), torch.ones(3, dtype=torch.float64))

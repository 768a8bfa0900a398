"""How a model's layers are split into pipeline stages, and a batch into micro-batches (one process)."""
import pytest
import torch
from torch import nn

from hvdtrain.parallel.pipeline.schedule import split_layers, split_micro_batches


def linears(*widths):
    """One nn.Linear(w, w, bias=False) per width: w * w parameters each."""
    return [nn.Linear(w, w, bias=False) for w in widths]


def test_every_layer_once_in_order_and_contiguous():
    layers = linears(2, 3, 4, 5, 6, 7, 8)
    for stages in range(1, 8):
        split = split_layers(layers, stages)
        assert len(split) == stages
        assert [i for indices in split for i in indices] == list(range(7))
        assert all(indices for indices in split)


def test_balanced_by_parameter_count():
    # 100, 100, 100, 100 parameters: two each.
    assert split_layers(linears(10, 10, 10, 10), 2) == [[0, 1], [2, 3]]
    # 400 | 100 + 100 + 100 + 100: the big layer alone.
    assert split_layers(linears(20, 10, 10, 10, 10), 2) == [[0], [1, 2, 3, 4]]
    # 16, 16, 400, 16, 16 into 3: the heavy layer alone in the middle.
    assert split_layers(linears(4, 4, 20, 4, 4), 3) == [[0, 1], [2], [3, 4]]


def test_balance_minimises_the_heaviest_stage():
    layers = linears(3, 9, 2, 7, 5, 4, 8, 1)
    costs = [w * w for w in (3, 9, 2, 7, 5, 4, 8, 1)]
    split = split_layers(layers, 3)
    heaviest = max(sum(costs[i] for i in indices) for indices in split)
    # Every contiguous split into 3 non-empty stages, by brute force.
    best = min(max(sum(costs[:a]), sum(costs[a:b]), sum(costs[b:]))
               for a in range(1, 7) for b in range(a + 1, 8))
    assert heaviest == best


def test_explicit_plan():
    assert split_layers(linears(1, 1, 1, 1, 1), 2, plan=[1, 4]) == [[0], [1, 2, 3, 4]]


@pytest.mark.parametrize("plan,message", [
    ([2, 2], "covers 4 layers, the model has 5"),
    ([1, 1, 3], "gives 3 stages, the pipeline has 2"),
    ([0, 5], "whole number >= 1 of layers"),
])
def test_a_plan_that_does_not_fit_is_refused(plan, message):
    with pytest.raises(ValueError, match=message):
        split_layers(linears(1, 1, 1, 1, 1), 2, plan=plan)


def test_fewer_layers_than_stages_is_refused():
    with pytest.raises(ValueError, match="3 layers cannot fill 4 pipeline stages"):
        split_layers(linears(1, 1, 1), 4)


def test_stages_must_be_a_whole_number():
    with pytest.raises(ValueError, match="whole number >= 1 of stages"):
        split_layers(linears(1, 1), 0)


def test_micro_batches_are_equal_slices_in_order():
    inputs, targets = torch.arange(12).reshape(6, 2), torch.arange(6)
    parts = split_micro_batches((inputs, targets), 3)
    assert len(parts) == 3
    assert torch.equal(torch.cat([x for x, _ in parts]), inputs)
    assert torch.equal(torch.cat([y for _, y in parts]), targets)
    assert all(len(x) == 2 for x, _ in parts)


def test_micro_batches_that_do_not_divide_the_batch_name_both_numbers():
    with pytest.raises(ValueError, match="4 micro-batches do not divide the batch of 6"):
        split_micro_batches((torch.zeros(6, 2), torch.zeros(6)), 4)


def test_textlm_pipeline_layers_share_the_model_modules():
    from hvdtrain.examples.textlm import TinyTransformerLM
    from hvdtrain.examples.textlm_parallel import pipeline_layers

    torch.manual_seed(0)
    model = TinyTransformerLM(vocab_size=20, seq_len=16, d_model=32, layers=3, heads=4).double()
    layers = pipeline_layers(model)
    assert len(layers) == 5
    assert layers[0].token is model.token and layers[-1].head is model.head
    assert any(p is model.token.weight for p in layers[-1].parameters())  # tied: first and last layer
    ids = torch.randint(0, 20, (2, 16))
    x = ids
    for layer in layers:
        x = layer(x)
    assert torch.equal(x, model(ids))

"""hvdtrain plan: the ZeRO arithmetic, the shape's exact parameter counts (whole, per pipeline stage,
per tensor rank) against the real TinyTransformerLM split as hvdtrain splits it, the layouts, the
recommendation and the error that says what would fit."""
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from hvdtrain import cli
from hvdtrain import planner
from hvdtrain.examples.textlm import TinyTransformerLM, planner_shape
from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
from hvdtrain.parallel.pipeline.schedule import split_layers
from hvdtrain.parallel.tensor.plan import parallelize
from hvdtrain.cli.plan import parse_bytes

SMALL = planner.ModelShape(layers=2, d_model=32, seq_len=8, vocab=11, heads=4)


def real_model(shape: planner.ModelShape) -> TinyTransformerLM:
    torch.manual_seed(0)
    return TinyTransformerLM(shape.vocab, seq_len=shape.seq_len, d_model=shape.d_model, layers=shape.layers,
                             heads=shape.heads)


def count(parameters) -> int:
    return sum(p.numel() for p in {id(p): p for p in parameters}.values())


def test_zero_paper_example():
    # Rajbhandari et al. 2020, Figure 1: 7.5B parameters, 64 GPUs, mixed-precision Adam (2 + 2 + 12 bytes).
    state = planner.state_bytes_per_parameter("adam", "bf16")
    assert state == 12
    per_rank = {s: sum(planner.sharded_state_bytes(s, 7.5e9, 2, 2, state, 64).values()) / 1e9
                for s in ("ddp", "zero1", "zero2", "fsdp")}
    assert {s: round(v, 1) for s, v in per_rank.items()} == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6, "fsdp": 1.9}


def test_fp32_adam_and_the_parameter_server():
    psi, n = 1000, 4
    held = lambda s, servers=1: sum(planner.sharded_state_bytes(s, psi, 4, 4, 8, n, servers).values())
    assert held("ddp") == 16 * psi and held("zero1") == 8 * psi + 8 * psi / n
    assert held("zero2") == 4 * psi + 12 * psi / n and held("fsdp") == 16 * psi / n
    # A server: its parameters and gradients, the summed gradients of its slice, the state of its slice.
    assert held("ps") == 4 * psi + 4 * psi + 4 * psi + 8 * psi
    assert held("ps", servers=2) == 4 * psi + 4 * psi + 2 * psi + 4 * psi
    assert planner.state_bytes_per_parameter("sgd", "fp32") == 4


@pytest.mark.parametrize("shape", [SMALL, planner.ModelShape(3, 48, 16, 29, 6)], ids=["small", "three-blocks"])
def test_parameter_count_formula_equals_the_real_model(shape):
    assert shape.shape_params == shape.total == count(real_model(shape).parameters())


def test_example_shape_is_the_default_textlm():
    shape = planner_shape()
    model = TinyTransformerLM(shape.vocab)  # the example's default config
    assert shape.total == count(model.parameters())
    assert (shape.layers, shape.d_model, shape.seq_len, shape.heads) == (2, 128, 64, 4)


@pytest.mark.parametrize("pipeline", [1, 2, 3, 4])
def test_stages_are_hvdtrains_split(pipeline):
    model = real_model(SMALL)
    layers = pipeline_layers(model)
    stages = split_layers(layers, pipeline)
    assert [list(s) for s in planner.stage_layers(SMALL, pipeline)] == stages
    # Per stage: its layers' distinct parameters (the tied matrix on both ends, once in a stage with both).
    real = [count(p for i in stage for p in layers[i].parameters()) for stage in stages]
    assert planner.stage_elements(SMALL, 1, pipeline) == real


@pytest.mark.parametrize("tensor", [2, 4])
def test_tensor_rank_elements_are_hvdtrains_split(tensor):
    model = real_model(SMALL)
    group = SimpleNamespace(size=tensor, index=0, ranks=tuple(range(tensor)), process_set=object())
    parallelize(model, tensor_plan(model), group)  # builds the slices; nothing communicates
    assert planner.stage_elements(SMALL, tensor, 1) == [count(model.parameters())]


def test_layouts_respect_heads_layers_and_batch():
    setup = planner.Setup(planner.ModelShape(2, 36, 8, 11, 3), batch=8, memory=1e9, workers=4)
    found = planner.layouts(setup)
    assert {(l.tensor, l.pipeline) for l in found} == {(1, 1), (1, 2), (1, 4)}  # heads 3: no T=2 or 4
    # hsdp needs nodes of more than one worker and fewer than all (test_plan_hsdp.py)
    assert {l.strategy for l in found if l.tensor * l.pipeline == 1} == set(planner.STRATEGIES) - {"hsdp"}
    # Over a mesh: ddp, and zero1 where there are data groups to shard over (not at D=1).
    assert sorted(l.strategy for l in found if l.pipeline == 2) == ["ddp", "zero1"]
    assert [l.strategy for l in found if l.pipeline == 4] == ["ddp"]
    assert {l.micro_batches for l in found if l.pipeline == 2} == {4}  # replica batch 4: at most 4
    uneven = planner.layouts(planner.Setup(SMALL, batch=6, memory=1e9, workers=4))  # 4 replicas cannot share 6
    assert uneven and all(6 % l.data == 0 for l in uneven) and all(l.data < 4 for l in uneven)


def test_recommendation_is_the_fastest_that_fits():
    setup = planner.Setup(planner_shape(), batch=64, memory=2 * 2 ** 30, workers=4)
    everything = [planner.estimate(setup, layout) for layout in planner.layouts(setup)]
    result = planner.make_plan(setup)
    assert result.recommended.step_s == min(e.step_s for e in everything)
    assert [e.step_s for e in result.fitting] == sorted(e.step_s for e in result.fitting)
    # Memory just below the fastest layout's total: the next fastest that fits is chosen.
    fastest = result.recommended
    tight = planner.make_plan(planner.Setup(setup.shape, 64, fastest.total - 1, 4))
    assert fastest.layout not in [e.layout for e in tight.fitting]
    assert tight.recommended.step_s == min(e.step_s for e in everything if e.total <= fastest.total - 1)
    assert "fastest modelled step" in tight.why()


def test_nothing_fits_says_what_would():
    setup = planner.Setup(planner_shape(), batch=64, memory=8 * 2 ** 20, workers=4)
    with pytest.raises(planner.NothingFits) as caught:
        planner.make_plan(setup)
    text = str(caught.value)
    least = min(planner.memory(setup, layout).total for layout in planner.layouts(setup))
    more = planner.fewest_workers(setup)
    workers = more.layout.data * more.layout.tensor * more.layout.pipeline
    assert workers > 4 and more.total <= setup.memory
    assert all(planner.memory(setup, l).total > setup.memory for w in range(5, workers) for l in planner.layouts(setup, w))
    assert "no layout fits 8.0 MiB per worker at 4 workers" in text
    assert f"the least any layout needs is {least / 2 ** 20:.1f} MiB per worker" in text
    assert f"the fewest workers that fit are {workers} ({more.layout.name}" in text
    assert "MODELLED" in text


def test_cli_prints_the_table_and_the_error(capsys):
    assert cli.main(["plan", "--example", "textlm", "--workers", "4", "--memory", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert "MODELLED (not measured)" in out and "step ms (modelled)" in out
    best = planner.make_plan(planner.Setup(planner_shape(), 64, 2 * 2 ** 30, 4)).recommended.layout
    assert f"recommended (modelled): {best.name}" in out and f"--train.strategy={best.strategy}" in out
    assert cli.main(["plan", "--example", "textlm", "--workers", "4", "--memory", "8MiB"]) == 2
    assert "the fewest workers that fit are" in capsys.readouterr().err
    assert cli.main(["plan", "--layers", "2", "--workers", "4", "--memory", "1GB"]) == 2
    assert "missing --d-model" in capsys.readouterr().err


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 ** 31 and parse_bytes("40GB") == 40e9 and parse_bytes("512 MiB") == 2 ** 29
    assert parse_bytes("1e9") == 1e9
    with pytest.raises(Exception):
        parse_bytes("2 parsecs")


def test_time_model_terms():
    setup = planner.Setup(SMALL, batch=32, memory=1e9, workers=4, network="10gbe")
    piped = planner.estimate(setup, planner.Layout("ddp", 1, 2, 2, 8))
    assert piped.bubble_s == pytest.approx(piped.compute_s * (2 - 1) / 8)  # (P-1)/(M+P-1) of the whole
    single = planner.estimate(setup, planner.Layout("ddp", 1, 1, 4))
    # 6 x parameters x tokens of a replica, at the device rate.
    assert single.compute_s == pytest.approx(6 * SMALL.total * (32 / 4) * SMALL.seq_len / planner.DEFAULT_FLOPS)
    # Same bytes for ddp and zero, but zero's all-gather is not hidden; fsdp moves 1.5x; one server moves 2 N x.
    estimates = {s: planner.estimate(setup, planner.Layout(s, 1, 1, 4)) for s in planner.STRATEGIES if s != "hsdp"}
    comm = {s: e.comm_s for s, e in estimates.items()}
    assert comm["ddp"] <= comm["zero1"] == comm["zero2"] < comm["ps"]
    # The update streams 28 bytes per parameter (Adam) on every ddp rank; zero1, zero2 and fsdp shard
    # it over the 4 data ranks, and the one server of ps updates the whole model.
    update = {s: e.update_s for s, e in estimates.items()}
    assert update["ddp"] == pytest.approx(SMALL.total * 28 / planner.DEFAULT_UPDATE_BANDWIDTH)
    assert update["zero1"] == update["zero2"] == update["fsdp"] == pytest.approx(update["ddp"] / 4)
    assert update["ps"] == pytest.approx(update["ddp"])
    two_servers = planner.estimate(replace(setup, ps_servers=2), planner.Layout("ps", 1, 1, 4))
    assert two_servers.update_s == pytest.approx(update["ddp"] / 2)
    for e in estimates.values():
        assert e.step_s >= e.compute_s + e.bubble_s + e.update_s + e.comm_s  # plus the straggler
    assert planner.estimate(setup, planner.Layout("ddp", 2, 1, 2)).comm_s > 0  # tensor all-reduces, every block


def test_zero1_over_a_mesh_shards_the_state_and_pays_the_parameters_broadcast():
    setup = planner.Setup(planner_shape(), batch=16, memory=2 ** 40, workers=4)
    ddp, zero1 = (planner.estimate(setup, planner.Layout(s, 2, 1, 2, 1)) for s in ("ddp", "zero1"))
    assert zero1.optimizer_state == ddp.optimizer_state / 2  # over D = 2 data groups
    assert (zero1.parameters, zero1.gradients) == (ddp.parameters, ddp.gradients)
    assert zero1.update_s == ddp.update_s / 2
    assert zero1.comm_s > ddp.comm_s  # the same all-reduce, then each parameter from its owner


LONG = planner.ModelShape(layers=8, d_model=1024, seq_len=8192, vocab=32000, heads=16)


def test_sequence_parallelism_is_a_layout_where_heads_and_sequence_divide():
    setup = planner.Setup(SMALL, batch=8, memory=2**40, workers=4)
    found = {layout.name for layout in planner.layouts(setup)}
    assert {"ddp T=1 P=1 D=2 S=2", "fsdp T=1 P=1 D=1 S=4", "zero2 T=1 P=1 D=2 S=2"} <= found
    assert not any(" S=" in name and name.startswith("ps ") for name in found)  # ps does not serve it
    odd = planner.Setup(replace(SMALL, d_model=36, heads=3), batch=8, memory=2**40, workers=4)
    assert not any(layout.sequence > 1 for layout in planner.layouts(odd))  # 3 heads split over no S > 1


def test_sequence_groups_inside_tensor_groups_are_layouts_where_each_ranks_heads_divide():
    """T x S (hvdtrain.parallel.sequence.groups): S divides each tensor rank's heads, the data group
    of D x S ranks is ddp's or ZeRO-1's; a tensor rank's all-to-alls carry its 1/T of the heads."""
    setup = planner.Setup(LONG, batch=2, memory=2**40, workers=8, precision="bf16")
    found = {layout.name: layout for layout in planner.layouts(setup)}
    assert {"ddp T=2 P=1 D=1 S=4", "zero1 T=2 P=1 D=2 S=2", "ddp T=4 P=1 D=1 S=2"} <= set(found)
    assert not any(layout.tensor > 1 and layout.sequence > 1 and layout.strategy in ("zero2", "fsdp")
                   for layout in found.values())
    # 16 heads: T=8 leaves 2 per rank, which S=4 cannot split.
    assert "ddp T=8 P=1 D=1 S=4" not in found and "ddp T=4 P=1 D=1 S=2" in found
    # The same sequences per group (D=1, S=4), with and without T=2: the tensor split's share on top.
    alone = planner.memory(setup, planner.Layout("ddp", 1, 1, 1, sequence=4))
    inside = planner.memory(setup, planner.Layout("ddp", 2, 1, 1, sequence=4))
    assert inside.activations < alone.activations and inside.parameters < alone.parameters


def test_tensor_and_sequence_splits_respect_the_key_value_heads():
    """Grouped-query attention, 16 query and 4 key/value heads: the tensor plan splits both alike, so
    T=8 is no layout (hvdtrain's plan refuses it). Inside T=2 each rank's 2 key/value heads are
    replicated onto S=4; with 3 key/value heads S=2 neither divides them nor is a multiple of them."""
    shape = replace(LONG, kv_heads=4)
    found = {layout.name for layout in planner.layouts(planner.Setup(shape, batch=2, memory=2**40, workers=8))}
    assert not any(name.startswith("ddp T=8 ") for name in found)
    assert "ddp T=8 P=1 D=1" in {layout.name for layout in planner.layouts(planner.Setup(LONG, batch=2, memory=2**40,
                                                                                            workers=8))}
    assert "ddp T=2 P=1 D=1 S=4" in found and "ddp T=4 P=1 D=1 S=2" in found
    three = replace(LONG, heads=12, d_model=1536, kv_heads=3)  # 3 key/value heads: S=2 neither divides nor replicates
    assert not any(layout.sequence == 2 for layout in planner.layouts(planner.Setup(three, batch=2, memory=2**40,
                                                                                    workers=8)))
    with pytest.raises(ValueError, match="key/value heads"):
        replace(LONG, kv_heads=5)


def test_sequence_parallelism_holds_a_share_of_the_activations_and_shards_over_every_rank():
    setup = planner.Setup(LONG, batch=4, memory=2**40, workers=4, precision="bf16")
    whole = planner.memory(setup, planner.Layout("fsdp", 1, 1, 4))
    split = planner.memory(setup, planner.Layout("fsdp", 1, 1, 1, sequence=4))
    assert split.states == pytest.approx(whole.states)  # fsdp shards over all 4 ranks either way
    # The same sequence per data group (one group of 4 ranks holds what one rank held, split 4 ways):
    # a quarter, plus attention's output in the tokens' layout per block.
    one_rank = planner.memory(planner.Setup(LONG, batch=4, memory=2**40, workers=1, precision="bf16"),
                              planner.Layout("ddp", 1, 1, 1))
    extra = LONG.layers * LONG.seq_len / 4 * 4 * LONG.d_model * 2  # 4 sequences of the group, bf16
    assert split.activations == pytest.approx(one_rank.activations / 4 + extra)


def test_a_long_context_on_more_workers_than_sequences_is_planned_with_sequence_parallelism():
    """Two sequences of 8192 tokens per step on 8 workers: data parallelism alone cannot use them all;
    tensor parallelism can, at four all-reduces of the whole activations per block, where sequence
    parallelism's all-to-alls move 1/S of them: the plan ranks it first and says how to run it."""
    setup = planner.Setup(LONG, batch=2, memory=16 * 2**30, workers=8, precision="bf16", network="nvlink",
                          gpus_per_node=8)
    plan = planner.make_plan(setup)
    best = plan.recommended
    unsplit = [e for e in plan.fitting if e.layout.sequence == 1]
    assert best.layout.sequence > 1 and unsplit, [e.layout.name for e in plan.fitting[:5]]
    assert best.step_s < min(e.step_s for e in unsplit)
    lines = "\n".join(cli.plan.table_lines(plan))
    assert f"--train.sequence_parallel={best.layout.sequence}" in lines

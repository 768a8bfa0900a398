"""hvdtrain plan and expert parallelism (E): a Hugging Face MoE model counted on the meta device, the
planner's bytes per rank against the split hvdtrain's expert parallelism makes of the same model,
the layouts E admits, the dispatch's all-to-all and the replica all-reduce in the step time, and the
table's E column and run line."""
import argparse
from dataclasses import replace

import pytest
import torch

from hvdtrain.cli import plan as plan_cli
from hvdtrain import planner
from hvdtrain.parallel.experts import ExpertGroups, fused_experts, split_experts
from hvdtrain.parallel.mesh import Group
from hvdtrain.planner.network import Calibration, Network
from hvdtrain.planner.step_time import dispatch_s

transformers = pytest.importorskip("transformers")

# Qwen2-MoE as tests/mpi/test_hf_experts.py trains it: 4 routed experts, top-2, a shared expert.
TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
            num_key_value_heads=4, max_position_embeddings=8, tie_word_embeddings=False, num_experts_per_tok=2,
            num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=24)
MOE = planner.ModelShape(layers=4, d_model=256, seq_len=128, vocab=1000, heads=4, params=60e6, experts=8, top_k=2,
                         moe_layers=4, expert_params=50e6)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2_moe")
    transformers.Qwen2MoeConfig(**TINY).save_pretrained(directory)
    torch.manual_seed(0)
    return directory, transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(**TINY))


def split_copy(model, size, rank):
    """The model as rank ``rank`` of an expert group of ``size`` holds it (no collective: only built)."""
    import copy

    model = copy.deepcopy(model)
    groups = ExpertGroups(size, Group(tuple(range(size)), rank, None), Group((rank,), rank, None), [])
    for path, module in fused_experts(model).items():
        parent, _, child = path.rpartition(".")
        setattr(model.get_submodule(parent), child, split_experts(module, groups, path))
    return model


def test_a_hugging_face_moe_is_counted_on_the_meta_device(tiny):
    directory, model = tiny
    shape = plan_cli.hf_shape(str(directory))
    experts = sum(p.numel() for m in fused_experts(model).values() for p in m.parameters(recurse=False))
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert (shape.experts, shape.top_k, shape.moe_layers, shape.expert_params) == (4, 2, 2, experts)
    # Routed experts only: the shared expert (3 x 32 x 24 per layer) and the router stay the rest.
    assert experts == 2 * 4 * 3 * 32 * 16
    assert (shape.layers, shape.d_model, shape.seq_len, shape.vocab, shape.heads) == (2, 32, 8, 64, 8)


@pytest.mark.parametrize("size", [2, 4])
def test_the_planners_bytes_per_rank_are_hvdtrains_expert_split(tiny, size):
    directory, model = tiny
    shape = plan_cli.hf_shape(str(directory))
    setup = planner.Setup(shape, batch=size, memory=2**40, workers=size)
    modelled = planner.memory(setup, planner.Layout("ddp", 1, 1, size, experts=size))
    for rank in range(size):
        held = split_copy(model, size, rank)
        real = sum(p.numel() * p.element_size() for p in held.parameters())
        assert modelled.parameters == real
        assert modelled.gradients == real and modelled.optimizer_state == 2 * real  # ddp, Adam in fp32
    whole = planner.memory(setup, planner.Layout("ddp", 1, 1, size))
    assert whole.parameters == sum(p.numel() * p.element_size() for p in model.parameters())


def test_expert_layouts_where_E_divides_the_experts_and_the_data_ranks():
    setup = planner.Setup(replace(MOE, experts=6), batch=8, memory=2**40, workers=8)
    expert_layouts = [layout.name for layout in planner.layouts(setup) if layout.experts > 1]
    # E=4 and E=8 do not divide 6 experts
    assert expert_layouts == [f"{s} T=1 P=1 D=8 E=2" for s in ("ddp", "zero1", "zero2", "fsdp")]
    assert [layout.experts for layout in planner.layouts(replace(setup, shape=MOE))
            if layout.experts > 1] == [2] * 4 + [4] * 4 + [8] * 4
    dense = replace(setup, shape=planner.ModelShape(layers=4, d_model=256, seq_len=128, vocab=1000, heads=4))
    assert all(layout.experts == 1 for layout in planner.layouts(dense))


def test_fsdp_shards_the_rest_and_holds_each_ranks_experts_whole():
    """fsdp x E (hvdtrain.strategies.fsdp.experts): the expert shares stay out of fsdp's units, so a
    rank holds its 1/E of the experts whole (as under ddp) and 1/N of everything else."""
    setup = planner.Setup(MOE, batch=8, memory=2**40, workers=8)
    ddp = planner.memory(setup, planner.Layout("ddp", 1, 1, 8, experts=4))
    fsdp = planner.memory(setup, planner.Layout("fsdp", 1, 1, 8, experts=4))
    rest, own = 10e6, 50e6 / 4  # MOE: 60M parameters, 50M of them routed experts
    assert ddp.parameters == pytest.approx(4 * (rest + own))
    assert fsdp.parameters == pytest.approx(4 * (rest / 8 + own))
    assert fsdp.optimizer_state == pytest.approx(8 * (rest / 8 + own))


def test_memory_holds_a_share_of_the_experts_and_the_rest_whole():
    setup = planner.Setup(MOE, batch=8, memory=2**40, workers=8)
    whole = planner.memory(setup, planner.Layout("ddp", 1, 1, 8))
    split = planner.memory(setup, planner.Layout("ddp", 1, 1, 8, experts=4))
    assert whole.parameters - split.parameters == pytest.approx(4 * 50e6 * 3 / 4)
    assert split.optimizer_state == pytest.approx(8 * (10e6 + 50e6 / 4))
    assert split.activations == whole.activations


def test_the_step_adds_the_dispatch_and_averages_the_experts_over_their_replicas():
    """One measured link (bench plan's), no overlap: the difference between E=2 and E=1 is the
    dispatch's all-to-alls, minus the experts' share of the data-parallel all-reduce over 8 ranks, plus
    their 1/2 over the 4 replicas, minus the half of the experts' update a rank no longer does."""
    link = Network("measured", gbit_s=8.0, alpha_us=100.0, transport="tcp", efficiency=1.0)  # 1e9 bytes/s
    setup = planner.Setup(MOE, batch=8, memory=2**40, workers=8, link=link, calibration=Calibration(0.0, 0.0, 1.0))
    whole = planner.estimate(setup, planner.Layout("ddp", 1, 1, 8))
    split = planner.estimate(setup, planner.Layout("ddp", 1, 1, 8, experts=2))
    pairs = 8 / 8 * 128 * 2  # a rank's tokens x top-2
    hidden = 4 * 4 * (pairs * 256 * 4 / 2 / 1e9 + 100e-6)  # 4 MoE layers x (out, back) x (forward, backward)
    small = 4 * 3 * (pairs * (2 * 4 + 8) / 3 / 2 / 1e9 + 100e-6)  # weights forward and back, indices forward
    assert dispatch_s(setup, split.layout) == pytest.approx(hidden + small)

    rest = planner.allreduce_s(setup, 10e6 * 4, 8, 1)  # all 8 ranks
    replicas = planner.allreduce_s(setup, 25e6 * 4, 4, 2)  # ranks 0, 2, 4, 6 hold the same experts
    assert split.comm_s == pytest.approx(rest + replicas + hidden + small)
    assert whole.comm_s == pytest.approx(planner.allreduce_s(setup, 60e6 * 4, 8, 1))
    assert split.update_s == pytest.approx(whole.update_s * 35 / 60)
    assert split.compute_s == whole.compute_s  # each rank computes as many pairs either way


def test_plan_ranks_expert_parallelism_and_says_how_to_run_it():
    """Experts too big for a rank whole, on a slow network: E=8 holds 1/8 of them and exchanges only
    its tokens, where the sharding strategies move parameters and tensor parallelism activations."""
    shape = replace(MOE, seq_len=1024, params=2.01e9, expert_params=2e9)
    setup = planner.Setup(shape, batch=16, memory=12 * 2**30, workers=8, precision="bf16", network="10gbe")
    plan = planner.make_plan(setup)
    assert plan.recommended.layout.name == "ddp T=1 P=1 D=8 E=8", [e.layout.name for e in plan.fitting[:4]]
    lines = "\n".join(plan_cli.table_lines(plan))
    assert "--train.strategy=ddp --train.batch_size=2 --train.expert_parallel=8" in lines
    header = next(line for line in lines.splitlines() if line.startswith("strategy"))
    assert header.split()[:7] == ["strategy", "T", "P", "S", "E", "D", "M"]
    assert "8 experts, top-2, in 4 layers" in lines


def args(**given):
    defaults = dict(example=None, hf=None, layers=4, d_model=256, seq_len=128, vocab=1000, heads=4, params=None,
                    experts=None, top_k=None, moe_layers=None, expert_params=None)
    return argparse.Namespace(**{**defaults, **given})


def test_the_command_line_takes_a_mixture_of_experts_shape():
    shape = plan_cli._shape(args(params=60e6, experts=8, top_k=2, expert_params=50e6))
    assert shape == MOE  # --moe-layers defaults to every layer
    with pytest.raises(ValueError, match="needs --experts, --top-k, --expert-params and --params.*--top-k, --params"):
        plan_cli._shape(args(experts=8, expert_params=50e6))
    with pytest.raises(ValueError, match="give --hf or the model's shape, not both \\(--layers"):
        plan_cli._shape(args(hf="qwen2_moe", d_model=None, vocab=None, heads=None, seq_len=None))
    with pytest.raises(ValueError, match="top-k between 1 and the experts \\(got 9\\)"):
        replace(MOE, top_k=9)
    with pytest.raises(ValueError, match="fewer than the blocks'"):
        replace(MOE, expert_params=60e6)


def test_a_dense_hugging_face_model_has_no_expert_layouts(tmp_path):
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, max_position_embeddings=16).save_pretrained(tmp_path)
    shape = plan_cli.hf_shape(str(tmp_path), seq_len=8)
    assert shape.experts == 0 and shape.seq_len == 8
    with pytest.raises(ValueError, match="neither a directory nor a model type"):
        plan_cli.hf_shape(str(tmp_path / "missing"))


def test_hvdtrain_plan_hf_lists_the_expert_layouts(tiny, capsys):
    directory, _ = tiny
    parser = argparse.ArgumentParser()
    plan_cli.add_arguments(parser)
    given = parser.parse_args(["--hf", str(directory), "--workers", "4", "--memory", "1GiB", "--batch", "4"])
    assert plan_cli.run(given) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("ddp ")]
    # strategy T P S E D M ...: ddp at E=2 and E=4 over the 4 data ranks, and without experts split.
    assert {tuple(row[1:7]) for row in rows} >= {("1", "1", "1", "2", "4", "1"), ("1", "1", "1", "4", "4", "1"),
                                                ("1", "1", "1", "1", "4", "1")}, out
    assert "4 experts, top-2, in 2 layers" in out and "seq 8," in out  # the config's 8 positions

"""Hugging Face mixture-of-experts decoders take one process's steps under every data-parallel
strategy (ddp, zero1, zero2, fsdp) and split by their own tensor-parallel plans (T=2; T=4 at 4
ranks): Qwen2-MoE (a shared expert and its gate, replicated; every layer sparse, so the plan's dense
MLP entries name nothing), Qwen3-MoE (one dense layer, split by those entries; per-head q/k norms)
and Mixtral (the router's load-balancing loss in the loss). Fused 3-D experts split as transformers
splits them (each expert's intermediate dimension cut, the experts' output summed over the tensor
group); routers whole. 3 AdamW steps, compared step by step (the loss) and at the end (every
parameter, gathered) with one process.

Float64 throughout (hvdtrain.verify.exact, in the reference and the layout alike), the experts run
by transformers' eager implementation: its default, grouped_mm, has no float64 kernel
(torch._grouped_mm takes float32, bfloat16 and float16 only). Why 1e-10 holds on any x86-64 CPU:
split products, all-reduced partial sums and averaged gradients differ from one process's only in
the order of float64 additions (relative 1e-16 per operation, a few hundred per step, 3 steps),
while a missing sum, a wrong slice or a gate cut apart from its up row moves values by more than
1e-4 (checked below by how far training moved them). The router's top-k is taken from the same
replicated values on every tensor rank, so each token goes to the same experts as in one process.
The default grouped_mm kernel is checked apart, in float32 (see its test for the bound).

The reference takes each step's batch as the layout's data-parallel ranks take it, one micro-batch
per data rank, gradients averaged: the load-balancing loss is a product of two means over a batch's
tokens, so data parallelism computes it per rank's batch (as every data-parallel framework does)
and one process must too; under T=2 at 2 ranks there is one data rank and one whole batch.
"""
import copy

import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain.checkpoint.consolidate import consolidate
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.distributed import collectives
from hvdtrain.examples.moe import MoEFeedForward, TinyMoELM, moe_lm_step
from hvdtrain.trainer import Trainer
from hvdtrain.verify.exact import float64_throughout
from tests.mpi.helpers import record_step_losses
from tests.mpi.test_mesh_checkpoint import differences, gathered
from tests.mpi import helpers

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets]

VOCAB, SEQ, BATCH, STEPS, SEED, AUX_COEF = 64, 8, 4, 3, 7, 0.1
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=SEQ, tie_word_embeddings=False, num_experts_per_tok=2)
FAMILIES = {
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(**SHAPE, num_experts=4, moe_intermediate_size=16,
                                                     shared_expert_intermediate_size=24),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, head_dim=8, num_experts=4, moe_intermediate_size=16,
                                                     mlp_only_layers=[1]),
    "mixtral": lambda: transformers.MixtralConfig(**SHAPE, num_local_experts=4, output_router_logits=True,
                                                  router_aux_loss_coef=AUX_COEF),
}
# hvdtrain's own mixture of experts (hvdtrain.examples.moe), the expert-parallel tests' fourth model: the
# same toy sizes, 4 experts of top-2 in both blocks, Switch's load-balancing loss in the loss.
EXAMPLE = "example"
LAYOUTS = {"ddp": {"strategy": "ddp"}, "zero1": {"strategy": "zero1"}, "zero2": {"strategy": "zero2"},
           "fsdp": {"strategy": "fsdp"}, "T2": {"tensor_parallel": 2}, "T4": {"tensor_parallel": 4}}


def make_model(family, seed, dtype=torch.float64, experts="eager"):
    torch.manual_seed(seed)
    if family == EXAMPLE:
        return TinyMoELM(VOCAB, seq_len=SEQ, d_model=32, layers=2, heads=4, num_experts=4, top_k=2,
                         expert_hidden=16).to(dtype)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[family](), experts_implementation=experts)
    return model.to(dtype)


def moe_step(model, batch):
    """Cross-entropy of the logits, plus the router's load-balancing loss where the model computes it."""
    if any(isinstance(module, MoEFeedForward) for module in model.modules()):
        return moe_lm_step(model, batch, AUX_COEF)
    inputs, targets = batch
    outputs = model(input_ids=inputs)
    loss = torch.nn.functional.cross_entropy(outputs.logits.reshape(-1, VOCAB), targets.reshape(-1))
    if outputs.aux_loss is not None:
        loss = loss + AUX_COEF * outputs.aux_loss
    return loss, {}


def token_data(samples: int = 64) -> TensorDataset:
    return helpers.token_data(VOCAB, SEQ, samples)


def data_ranks_orders(size, data_ranks):
    """Each data rank's samples in the order its ShardedSampler gives them."""
    orders = []
    for rank in range(data_ranks):
        sampler = ShardedSampler(size, rank=rank, world_size=data_ranks, seed=SEED)
        sampler.set_epoch(0)
        orders.append(list(sampler))
    return orders


def reference(family, initial, data, data_ranks, optimizer_class=torch.optim.AdamW, lr=0.01, **model_options):
    """One process, no Horovod: each step, one micro-batch per data rank (its own batch), the
    gradients averaged. Returns the final state and each step's loss (the data ranks' mean)."""
    model = make_model(family, 0, **model_options)
    model.load_state_dict(initial)
    optimizer = optimizer_class(model.parameters(), lr=lr)
    orders = data_ranks_orders(len(data), data_ranks)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        total = 0.0
        for order in orders:
            batch = order[step * BATCH:(step + 1) * BATCH]
            loss, _ = moe_step(model, (data.tensors[0][batch], data.tensors[1][batch]))
            (loss / len(orders)).backward()
            total += loss.item() / len(orders)
        optimizer.step()
        losses.append(total)
    return model.state_dict(), losses


def make_trainer(world, model, data, optimizer_class=torch.optim.AdamW, lr=0.01, max_steps=STEPS, **settings):
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=lr, scale_lr=False, warmup_epochs=0, max_steps=max_steps,
                         seed=SEED, log_every=1000, tensorboard=False, **settings)
    return Trainer(model, optimizer_class(model.parameters(), lr=lr), data, None, config, world=world,
                   step_fn=moe_step)


_REFERENCES = {}


def reference_of(family, initial, data, data_ranks, **options):
    """reference(), computed once for the layouts that share its start (rank 0's model, broadcast)
    and its data ranks: the suite's time goes to the layouts."""
    key = (family, data_ranks, tuple(sorted((k, str(v)) for k, v in options.items())))
    cached = _REFERENCES.get(key)
    if cached is None or any(not torch.equal(cached[0][name], initial[name]) for name in initial):
        _REFERENCES[key] = cached = (initial, *reference(family, initial, data, data_ranks, **options))
    return cached[1], cached[2]


def train(world, family, optimizer_class=torch.optim.AdamW, lr=0.01, model_options=None, **settings):
    """(the trainer, the data, its initial and final gathered model, each step's loss averaged over the world)."""
    data = token_data()
    model = make_model(family, 100 + world.rank, **(model_options or {}))  # set-up must broadcast rank 0's
    trainer = make_trainer(world, model, data, optimizer_class, lr, **settings)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    losses = record_step_losses(trainer)
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    step_losses = collectives.allreduce_sum(torch.stack(losses), name=f"moe.{family}.{settings}.losses") / world.size
    return trainer, data, initial, final, step_losses


def differences_from_one_process(family, data, initial, final, step_losses, data_ranks, **reference_options):
    """(max |gathered - one process| over every parameter, max per-step loss difference, the least
    any weight moved in training, the least any expert's weight moved)."""
    expected, expected_losses = reference_of(family, initial, data, data_ranks, **reference_options)
    assert set(final) == set(expected)
    worst = max((final[name] - expected[name]).abs().max().item() for name in expected)
    moved = min((expected[name] - initial[name]).abs().max().item() for name in expected)
    experts_moved = min((expected[name] - initial[name]).abs().max().item() for name in expert_names(expected))
    loss_error = (step_losses - torch.tensor(expected_losses, dtype=torch.float64)).abs().max().item()
    return worst, loss_error, moved, experts_moved


def expert_names(state):
    return sorted(name for name in state if ".experts." in name)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_layout_takes_one_process_steps(world, family, layout):
    settings = LAYOUTS[layout]
    tensor = settings.get("tensor_parallel", 1)
    if world.size % tensor or world.size == 1:
        pytest.skip(f"{layout} needs a world that divides by {tensor}, of 2 ranks or more")
    with float64_throughout():
        trainer, data, initial, final, step_losses = train(world, family, **settings)
        split = {name: p for name, p in trainer.model.named_parameters() if hasattr(p, "tensor_shard")}
        if tensor > 1:
            trainer.close_mesh()
        worst, loss_error, moved, _ = differences_from_one_process(family, data, initial, final, step_losses,
                                                                   world.size // tensor)
    print(f"\n{family} {layout} at {world.size} ranks: max |param - one process| {worst:.2e}, "
          f"max |loss - one process| {loss_error:.2e}")

    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {loss_error}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"
    if tensor > 1:
        # Every expert's parameters are split (a slice of the intermediate dimension each) and
        # gathered whole; routers, the shared expert and its gate stay whole.
        assert expert_names(final) and all(name in split for name in expert_names(final))
        for name in expert_names(final):
            dim = split[name].tensor_shard.dim
            assert split[name].shape[dim] * tensor == final[name].shape[dim] and dim == (1 if "gate_up" in name else 2)
        assert not any(".mlp.gate." in name or "shared_expert" in name for name in split)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["tensor_parallel", "expert_parallel"])
def test_the_default_grouped_mm_kernel_splits_in_float32(world, layout):
    """grouped_mm (transformers' default experts implementation) has no float64 kernel: Qwen3-MoE in
    float32 under T=2 (each expert's intermediate rows split) and under E=2 (each rank a half of the
    experts, so the kernel's groups are the tokens the other rank's router sent) against one process
    running the same kernel, under SGD (its step is linear in
    the gradient; Adam's near-sign step turns a rounding difference in a gradient near its eps into
    a difference of a whole step). Bound 1e-6 with every expert weight moved by more than 5e-5 in
    training: the layouts differ only in the order of float32 additions (relative 6e-8 each; measured
    7e-9 with torch's AVX2 kernels and 1.7e-8 with its scalar ones, ATEN_CPU_CAPABILITY=default; the
    AVX-512 kernels, not on the machine measured, likewise change only how a sum is grouped), while a missing sum over the group or a [gate; up] cut apart changes the experts'
    gradients by a fraction of themselves, so their weights by a fraction of 5e-5 (1.1e-4 and more here,
    at 2 and 4 ranks)."""
    if world.size % 2:
        pytest.skip(f"{layout}=2 needs an even world")
    options = dict(dtype=torch.float32, experts="grouped_mm")
    trainer, data, initial, final, step_losses = train(world, "qwen3_moe", torch.optim.SGD, 0.1, options,
                                                       **{layout: 2})
    implementation = trainer.model.config._experts_implementation
    split = sorted(name for name, p in trainer.model.named_parameters() if hasattr(p, "expert_shard"))
    trainer.close_mesh()
    data_ranks = world.size // 2 if layout == "tensor_parallel" else world.size  # expert groups keep their data
    worst, loss_error, _, experts_moved = differences_from_one_process(
        "qwen3_moe", data, initial, final, step_losses.double(), data_ranks, optimizer_class=torch.optim.SGD,
        lr=0.1, **options)
    print(f"\nqwen3_moe grouped_mm float32 {layout}=2 SGD: max |param - one process| {worst:.2e}, "
          f"loss {loss_error:.2e}, experts moved >= {experts_moved:.2e}")

    assert implementation == "grouped_mm"
    assert bool(split) == (layout == "expert_parallel")  # the experts dealt out, under E only
    assert experts_moved > 5e-5, "training did not move every expert's weights: the test proves nothing"
    # The loss is near 4, where float32's spacing is 4.8e-7: 5e-6 is ten of those steps.
    assert worst < 1e-6 and loss_error < 5e-6, (worst, loss_error)


@pytest.mark.timeout(240)
def test_split_experts_round_trip_through_checkpoints(world, shared_tmp_path):
    """Qwen2-MoE at T=2 writes a sharded checkpoint (each rank its slices of the 3-D experts, their
    Adam moments cut alike): read back at T=2 and under fsdp (whole parameters), consolidated in one
    process, and the gathered state loaded into a fresh T=2 model: exactly the state written."""
    if world.size % 2:
        pytest.skip("tensor_parallel=2 needs an even world")
    directory, data = shared_tmp_path / "ckpt", token_data()
    steps = 2

    def trainer_in(path, seed, **layout):
        return make_trainer(world, make_model("qwen2_moe", seed), data, max_steps=steps, checkpoint_dir=str(path),
                            checkpoint_format="sharded", **layout)

    written = trainer_in(directory, 100 + world.rank, tensor_parallel=2)
    written.fit()
    saved = gathered(written)
    checkpoint = directory / f"ckpt-{steps:09d}"
    resumed = {}
    for name, layout in (("T2", {"tensor_parallel": 2}), ("fsdp", {"strategy": "fsdp"})):
        trainer = trainer_in(directory, 200, **layout)  # resumes step 2 of 2: nothing left to train
        trainer.fit()
        resumed[name] = differences(gathered(trainer), saved)
    fresh = make_trainer(world, make_model("qwen2_moe", 300), data, tensor_parallel=2)
    fresh.strategy.load_state_dict(saved)
    resumed["loaded whole at T2"] = differences(gathered(fresh), saved)
    consolidated = differences(consolidate(checkpoint), saved) if world.is_root else None
    consolidated = collectives.broadcast_object(consolidated, root_rank=0, name="moe.consolidated")

    shape = saved["model"]["model.layers.0.mlp.experts.gate_up_proj"].shape
    assert tuple(shape) == (4, 2 * 16, 32), "gathered whole: every expert, [gate; up] of 2 x 16 rows"
    assert resumed == {"T2": [], "fsdp": [], "loaded whole at T2": []}
    assert consolidated == []


@pytest.mark.timeout(240)
def test_a_moe_model_built_on_meta_splits_its_experts_as_built_whole(world):
    """Built on the meta device, split at T=2 while it holds no memory, then each rank initializes
    only its slices: the values of the model built whole from the same seed, bitwise (the experts'
    3-D parameters drawn whole, in the same order, then cut)."""
    if world.size % 2:
        pytest.skip("tensor_parallel=2 needs an even world")
    torch.manual_seed(SEED)  # the Trainer's train.seed
    whole = transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen2_moe"](), experts_implementation="eager")
    with torch.device("meta"):
        meta_model = transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen2_moe"](),
                                                                    experts_implementation="eager")
    trainer = make_trainer(world, meta_model, token_data(), tensor_parallel=2)
    local = meta_model.model.layers[0].mlp.experts.gate_up_proj
    start = gathered(trainer)

    assert tuple(local.shape) == (4, 16, 32) and local.tensor_shard.groups == 2
    assert differences(start, {"model": whole.state_dict(), "optimizer": {"state": {}}}) == []

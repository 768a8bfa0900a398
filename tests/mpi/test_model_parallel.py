"""Tensor and pipeline parallelism through the Trainer take the same steps as one process on the
same global batch: the example transformer, in float64, at every layout that fits the world
(T=2; P=2 under both schedules; T=2 x D=2; P=2 x D=2; T=2 x P=2; P=4), compared step by step
(the loss) and at the end (every parameter, gathered), to 1e-10.

Why 1e-10 holds on any x86-64 CPU: in float64, the split matrix products and the all-reduced
partial sums differ from one process's only by the order of additions, a relative 1e-16 per
operation over a few hundred operations per step and 4 steps; 1e-10 leaves six orders of margin
and still catches any real mistake (a missing all-reduce or a wrong slice moves values by > 1e-3,
checked below by how far training moved the parameters).
"""
import copy

import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.trainer import Trainer
from tests.mpi.helpers import record_step_losses
from tests.mpi import helpers

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.np4(reason="T=2 x D=2, P=2 x D=2, T=2 x P=2 and P=4 fit only at 4 ranks"),
    pytest.mark.gloo_np4(reason="the mesh's process sets over Gloo: 4 ranks fit every layout, and Gloo's dynamic "
                                "process sets are another implementation of the groups"),
]

VOCAB, SEQ, WIDTH, HEADS, BLOCKS = 11, 8, 16, 4, 2
# (tensor, pipeline, schedule, micro-batches): each runs where tensor x pipeline divides the world.
LAYOUTS = [(2, 1, "1f1b", 1), (1, 2, "gpipe", 2), (1, 2, "1f1b", 4), (2, 2, "1f1b", 2), (1, 4, "1f1b", 2),
           (4, 1, "1f1b", 1)]
BATCH, STEPS, SEED = 4, 4, 7


def make_model(seed: int) -> TinyTransformerLM:
    torch.manual_seed(seed)
    return TinyTransformerLM(VOCAB, seq_len=SEQ, d_model=WIDTH, layers=BLOCKS, heads=HEADS).double()


def token_data(samples: int = 96) -> TensorDataset:
    return helpers.token_data(VOCAB, SEQ, samples)


def reference(initial, data, global_batch, max_grad_norm=None):
    """One process, no Horovod: the global batches in the samplers' global order."""
    model = make_model(0)
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=SEED)
    sampler.set_epoch(0)
    order = list(sampler)
    inputs, targets = data.tensors
    losses = []
    for step in range(STEPS):
        batch = order[step * global_batch:(step + 1) * global_batch]
        optimizer.zero_grad()
        loss = lm_loss(model(inputs[batch]), targets[batch])
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    return model.state_dict(), optimizer.state_dict(), losses


def layout_id(layout):
    t, p, schedule, m = layout
    return f"T{t}-P{p}-{schedule}-M{m}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_layout_matches_one_process(world, layout):
    check_layout(world, layout)


# Clipped to a norm well below the gradients' (about 1 at the start): every step is clipped.
CLIP_LAYOUTS = [(2, 1, "1f1b", 1), (1, 2, "1f1b", 2), (2, 2, "gpipe", 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", CLIP_LAYOUTS, ids=layout_id)
def test_clipping_counts_every_element_once(world, layout):
    """The global norm over a split model: split slices summed, replicated and tied parameters and
    data replicas counted once; equal to one process clipping the global batch's gradient."""
    check_layout(world, layout, max_grad_norm=0.05)


# ZeRO-1 over each data-parallel group: at 4 ranks D=2, each data rank steps about half of its
# replica's parameters and broadcasts them; at 2 ranks D=1 and it is ddp's step.
ZERO1_LAYOUTS = [(2, 1, "1f1b", 1), (1, 2, "1f1b", 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ZERO1_LAYOUTS, ids=layout_id)
def test_zero1_over_the_data_groups_matches_one_process(world, layout):
    check_layout(world, layout, strategy="zero1")


# Every block computed again in backward: a tensor-parallel block's all-reduces run again there, a
# pipeline stage recomputes its own blocks; the steps stay one process's.
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [(2, 1, "1f1b", 1), (1, 2, "1f1b", 2), (2, 2, "gpipe", 2)], ids=layout_id)
def test_activation_checkpointing_matches_one_process(world, layout):
    check_layout(world, layout, activation_checkpointing="full")


def check_layout(world, layout, max_grad_norm=None, strategy="ddp", activation_checkpointing="none"):
    tensor, pipeline, schedule, micro = layout
    if world.size % (tensor * pipeline):
        pytest.skip(f"T={tensor} x P={pipeline} does not divide {world.size} ranks")
    if pipeline > BLOCKS + 2:
        pytest.skip("more stages than layers")
    data = token_data()
    model = make_model(100 + world.rank)  # different on every rank: set-up must broadcast rank 0's
    config = TrainConfig(epochs=1, batch_size=BATCH, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                         seed=SEED, log_every=1000, tensor_parallel=tensor, pipeline_parallel=pipeline,
                         pipeline_schedule=schedule, micro_batches=micro, max_grad_norm=max_grad_norm,
                         strategy=strategy, activation_checkpointing=activation_checkpointing)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world,
                      loss_fn=lm_loss, model_plan=ModelPlan(tensor_plan=tensor_plan(model), pipeline_layers=pipeline_layers))
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    losses = record_step_losses(trainer)
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    data_width = trainer.parts.topology.mesh.shape.data
    # Each data replica's loss; the global batch's loss is their mean (every rank of a replica holds it).
    # Every replica's T x P ranks hold its loss: the world's sum / world size is the mean over replicas.
    step_losses = collectives.allreduce_sum(torch.stack(losses), name=f"mp.{layout_id(layout)}.losses") / world.size
    memories = collectives.allgather_object(trainer.strategy.memory_bytes(), name=f"mp.{layout_id(layout)}.memory")

    final_optimizer = trainer.strategy.state_dict()["optimizer"]
    expected, expected_optimizer, expected_losses = reference(initial, data, BATCH * data_width, max_grad_norm)
    grad_norm = trainer.parts.loop.grad_norm  # before clipping, at the last step
    # A full checkpoint resumes under any layout: loading one process's state and gathering it back
    # gives it unchanged, bit for bit (each element travels once, added to zeros).
    trainer.strategy.load_state_dict({"model": expected, "optimizer": expected_optimizer})
    round_trip = trainer.strategy.state_dict()
    worst = max((final[name] - expected[name]).abs().max().item() for name in expected)
    optimizer_worst = max((final_optimizer["state"][i][key] - value).abs().max().item()
                          for i, state in expected_optimizer["state"].items() for key, value in state.items())
    moved = max((expected[name] - initial[name]).abs().max().item() for name in expected)
    loss_error = (step_losses - torch.tensor(expected_losses, dtype=torch.float64)).abs().max().item()
    trainer.close_mesh()  # the last collective: left open, every later test's collectives slow down

    assert trainer.global_step == STEPS
    assert len(trainer.parts.recomputed_blocks) == (BLOCKS if activation_checkpointing == "full" else 0)
    assert moved > 1e-3, "training did not move the parameters: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {step_losses.tolist()} vs {expected_losses}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"
    if max_grad_norm is not None:
        assert grad_norm > 2 * max_grad_norm, f"the norm {grad_norm} was not clipped: the test proves nothing"
    assert optimizer_worst < 1e-10, f"optimizer state: max |gathered - one process| = {optimizer_worst}"
    # The Trainer's LR schedule adds initial_lr to each group; the rest is the optimizer's own.
    groups = [{k: v for k, v in g.items() if k != "initial_lr"} for g in final_optimizer["param_groups"]]
    assert groups == expected_optimizer["param_groups"]
    assert all(torch.equal(round_trip["model"][name], expected[name]) for name in expected)
    assert all(torch.equal(round_trip["optimizer"]["state"][i][key], value)
               for i, state in expected_optimizer["state"].items() for key, value in state.items())
    full_bytes = sum(t.numel() * t.element_size() for t in initial.values()) - initial["head.weight"].numel() * 8
    # The model divided by T x P, plus what every tensor rank keeps whole (norms, embeddings, biases of
    # row-parallel layers) and the tied matrix held by both ends of a pipeline.
    held = max(memory["parameters"] for memory in memories)
    assert held < full_bytes, f"a rank holds {held} parameter bytes of {full_bytes}"
    if strategy == "zero1" and data_width > 1:
        # Each data group's ranks hold its replica-part's optimizer state once between them, dealt
        # out by whole tensors: about 1/D each. 0.7 of the group's total allows for the tensors'
        # granularity (the largest is under a third of a rank's parameters here); ddp would hold all of it.
        state = [memory["optimizer_state"] for memory in memories]
        per_part = world.size // data_width
        for part in range(per_part):
            group = state[part::per_part]  # the same stage and tensor rank in every data replica
            assert max(group) < 0.7 * sum(group), f"zero1 did not shard the optimizer state: {group}"


@pytest.mark.timeout(120)
def test_dropout_masks_agree_within_a_tensor_group(world):
    """With dropout, a tensor group's ranks compute the replicated activations alike only if they
    draw the same masks: they share the random stream of the group's first rank. Otherwise the
    replicated parameters (the LayerNorms) drift apart from the first step."""
    if world.size % 2:
        pytest.skip("tensor_parallel=2 needs an even number of ranks")
    torch.manual_seed(0)
    model = TinyTransformerLM(VOCAB, seq_len=SEQ, d_model=WIDTH, layers=BLOCKS, heads=HEADS, dropout=0.3).double()
    config = TrainConfig(epochs=1, batch_size=BATCH, scale_lr=False, warmup_epochs=0, max_steps=3, seed=SEED,
                         log_every=1000, tensor_parallel=2)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), token_data(), None, config, world=world,
                      loss_fn=lm_loss, model_plan=ModelPlan(tensor_plan=tensor_plan(model), pipeline_layers=pipeline_layers))
    before = model.norm.weight.detach().clone()
    trainer.fit()
    replicated = torch.cat([model.norm.weight.detach(), model.blocks[0].norm1.bias.detach()])
    rows = collectives.allgather_rows(replicated, name="mp.dropout.replicated")
    trainer.close_mesh()
    groups = [rows[r:r + 2] for r in range(0, world.size, 2)]

    assert (model.norm.weight.detach() - before).abs().max() > 1e-4, "training did not move the norm"
    assert all(torch.equal(group[0], group[1]) for group in groups), "a tensor group's replicated parameters differ"

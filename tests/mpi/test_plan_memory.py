"""hvdtrain plan's memory model against hvdtrain's own counts: for the example transformer (small,
float32, Adam) under every layout that runs at this world size, the busiest rank's parameter +
gradient + optimizer-state bytes counted from the tensors' storages after the first step (the
Trainer's MemoryReport, gathered from every rank) are within 10% of what plan predicts; sequence
parallelism's layouts (S=2: the strategy shards over every rank of every sequence group) too.
Activations are not counted by the strategies, so they are not compared.

    mpirun -np 4 python -m pytest --with-mpi -p no:cacheprovider -s tests/mpi/test_plan_memory.py
"""
import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain import planner
from hvdtrain.config.train import TrainConfig
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.common.units import format_bytes
from hvdtrain.trainer import Trainer
from tests.mpi import helpers

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.np1(reason="the flat strategies' layouts at one rank"),
    pytest.mark.np4(reason="every layout plan predicts, T x P x D, fits only at 4 ranks"),
    pytest.mark.gloo_np4(reason="the mesh's process sets over Gloo: 4 ranks fit every layout, and Gloo's dynamic "
                                "process sets are another implementation of the groups"),
]

SHAPE = planner.ModelShape(layers=2, d_model=32, seq_len=8, vocab=11, heads=4)
BATCH, MICRO = 4, 2  # per data replica; micro-batches when pipelined
# (strategy, tensor, pipeline, sequence): each runs where tensor x pipeline x sequence divides the world.
LAYOUTS = [("ddp", 1, 1, 1), ("zero1", 1, 1, 1), ("zero2", 1, 1, 1), ("fsdp", 1, 1, 1), ("ps", 1, 1, 1),
           ("ddp", 2, 1, 1), ("ddp", 1, 2, 1), ("ddp", 2, 2, 1), ("ddp", 4, 1, 1), ("ddp", 1, 4, 1),
           ("zero1", 2, 1, 1), ("zero1", 1, 2, 1), ("ddp", 1, 1, 2), ("zero1", 1, 1, 2), ("fsdp", 1, 1, 2)]
ROWS = []  # (layout, predicted, counted), filled by the runs, printed by the last test


def token_data(samples: int = 64) -> TensorDataset:
    return helpers.token_data(SHAPE.vocab, SHAPE.seq_len, samples)


def layout_id(layout):
    strategy, tensor, pipeline, sequence = layout
    return f"{strategy}-T{tensor}-P{pipeline}" + (f"-S{sequence}" if sequence > 1 else "")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_predicted_memory_within_ten_percent_of_counted(world, layout):
    strategy, tensor, pipeline, sequence = layout
    if world.size % (tensor * pipeline * sequence):
        pytest.skip(f"T={tensor} x P={pipeline} x S={sequence} does not divide {world.size} ranks")
    data = world.size // (tensor * pipeline * sequence)
    micro = MICRO if pipeline > 1 else 1
    torch.manual_seed(0)
    model = TinyTransformerLM(SHAPE.vocab, seq_len=SHAPE.seq_len, d_model=SHAPE.d_model, layers=SHAPE.layers,
                              heads=SHAPE.heads)
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=1,
                         seed=7, log_every=1000, strategy=strategy, tensor_parallel=tensor,
                         pipeline_parallel=pipeline, micro_batches=micro, sequence_parallel=sequence)
    trainer = Trainer(model, torch.optim.Adam(model.parameters(), lr=0.01), token_data(), None, config,
                      world=world, loss_fn=lm_loss, model_plan=ModelPlan(tensor_plan=tensor_plan(model), pipeline_layers=pipeline_layers))
    trainer.fit()  # the MemoryReport gathers every rank's counts after the first step (a collective)
    per_rank = trainer.parts.reporter.memory.per_rank
    counted = max(r["parameters"] + r["gradients"] + r["optimizer_state"] for r in per_rank)
    trainer.close_mesh()
    setup = planner.Setup(SHAPE, batch=BATCH * data, memory=2 ** 40, workers=world.size)
    planned = planner.Layout(strategy, tensor, pipeline, data, micro, sequence=sequence)
    predicted = planner.memory(setup, planned).states
    ROWS.append((planned.name, predicted, counted))

    assert trainer.global_step == 1
    assert abs(predicted - counted) <= 0.10 * counted, (
        f"{layout_id(layout)}: predicted {predicted:.0f} bytes, counted {counted} (max over ranks)")


def test_print_predicted_against_counted(world):
    if world.is_root and ROWS:
        print(f"\nplan memory per rank at {world.size} ranks (parameters + gradients + optimizer state; "
              f"predicted = MODELLED, counted = max over ranks of strategy.memory_bytes())")
        print(f"{'layout':<24} {'predicted':>12} {'counted':>12} {'error':>8}")
        for name, predicted, counted in ROWS:
            print(f"{name:<24} {format_bytes(predicted):>12} {format_bytes(counted):>12} "
                  f"{100 * (predicted - counted) / counted:>+7.2f}%")

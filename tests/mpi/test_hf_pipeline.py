"""Hugging Face decoders cut into pipeline stages by themselves (no pipeline_layers given): the
embedding, each decoder layer, the norm with the head; each stage computes the mask and rotary
position embeddings its model would. Llama (its tied embedding and head on the first and last
stage), Qwen3 and Mistral take one process's steps in float64: P=2 under 1f1b and gpipe (2 ranks),
P=2 x D=2 and T=2 x P=2 (4 ranks, the tensor split by the model's own plan), each step's loss and
every gathered parameter to 1e-10 (the bound of test_model_parallel.py, for the same reason).
"""
import copy

import pytest
import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from tests.mpi.test_hf_equivalence import BATCH, SEED, STEPS, VOCAB, make_model, reference, token_data

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets]

# (tensor, pipeline, schedule, micro-batches): each runs where tensor x pipeline divides the world.
LAYOUTS = [(1, 2, "1f1b", 2), (1, 2, "gpipe", 4), (2, 2, "1f1b", 2)]


def logits_loss(outputs, targets):
    """Cross-entropy of the logits (a pipeline's last stage gives the logits themselves)."""
    return torch.nn.functional.cross_entropy(outputs.reshape(-1, VOCAB), targets.reshape(-1))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "T{}-P{}-{}-M{}".format(*layout))
def test_the_model_cut_into_stages_takes_one_process_steps(world, family, layout):
    tensor, pipeline, schedule, micro = layout
    if world.size % (tensor * pipeline):
        pytest.skip(f"T={tensor} x P={pipeline} does not divide {world.size} ranks")
    data = token_data()
    model = make_model(family, 100 + world.rank)
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                         seed=SEED, log_every=1000, tensorboard=False, tensor_parallel=tensor,
                         pipeline_parallel=pipeline, pipeline_schedule=schedule, micro_batches=micro)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world,
                      loss_fn=logits_loss)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    losses = []
    train_batch = trainer.strategy.forward_backward

    def recording(*args, **kwargs):
        loss, metrics = train_batch(*args, **kwargs)
        losses.append(loss.detach().double().reshape(()))
        return loss, metrics

    trainer.strategy.forward_backward = recording
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    name = f"hf.pp.{family}.T{tensor}P{pipeline}{schedule}"
    step_losses = collectives.allreduce_sum(torch.stack(losses), name=f"{name}.losses") / world.size
    stages = collectives.allgather_object(len(trainer.strategy.pipeline.module.layers), name=f"{name}.layers")
    trainer.close_mesh()

    data_width = world.size // (tensor * pipeline)
    expected, expected_losses = reference(family, initial, data, BATCH * data_width)
    worst = max((final[key] - expected[key]).abs().max().item() for key in expected)
    moved = min((expected[key] - initial[key]).abs().max().item() for key in expected if key.endswith("weight"))
    loss_error = (step_losses - torch.tensor(expected_losses, dtype=torch.float64)).abs().max().item()

    # 2 decoder layers + the embedding and the norm with the head: 4 layers over the stages.
    assert sum(stages[:pipeline * tensor:tensor]) == 4 and min(stages) >= 1
    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {step_losses.tolist()} vs {expected_losses}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"

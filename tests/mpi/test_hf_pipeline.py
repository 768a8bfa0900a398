"""Hugging Face decoders cut into pipeline stages by themselves (no pipeline_layers given): the
embedding, each decoder layer, the norm with the head; each stage computes the mask and rotary
position embeddings its model would. Llama (its tied embedding and head on the first and last
stage), Qwen3 and Mistral take one process's steps in float64: P=2 under 1f1b and gpipe (2 ranks),
P=2 x D=2 and T=2 x P=2 (4 ranks, the tensor split by the model's own plan), each step's loss and
every gathered parameter to 1e-10 (the bound of test_model_parallel.py, for the same reason). The
last stage reports the metrics the Trainer's step reports without a pipeline (the token accuracy),
in training and evaluation, equal to one process's.
"""
import copy

import pytest
import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.distributed import collectives
from hvdtrain.parallel.pipeline.hf_layers import causal_lm_loss
from hvdtrain.trainer import Trainer
from hvdtrain.training.steps import supervised_step
from tests.mpi.helpers import record_step_losses
from tests.mpi.test_hf_equivalence import (BATCH, SEED, SEQ, STEPS, VOCAB, causal_lm_step, check_against_one_process,
                                           logits_loss, make_model, token_data, train)

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets]

# (tensor, pipeline, schedule, micro-batches): each runs where tensor x pipeline divides the world.
LAYOUTS = [(1, 2, "1f1b", 2), (1, 2, "gpipe", 4), (2, 2, "1f1b", 2)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "T{}-P{}-{}-M{}".format(*layout))
def test_the_model_cut_into_stages_takes_one_process_steps(world, family, layout):
    tensor, pipeline, schedule, micro = layout
    if world.size % (tensor * pipeline):
        pytest.skip(f"T={tensor} x P={pipeline} does not divide {world.size} ranks")
    metrics = []
    trainer, data, initial, final, step_losses = train(
        world, family, step={"loss_fn": logits_loss}, metrics_seen=metrics, tensor_parallel=tensor,
        pipeline_parallel=pipeline, pipeline_schedule=schedule, micro_batches=micro)
    stages = collectives.allgather_object(len(trainer.strategy.pipeline.module.layers),
                                          name=f"hf.pp.{family}.{layout}.layers")
    # Each replica's batches are equal in size: the world's mean of the steps' accuracies is the global batch's.
    nan = torch.tensor(float("nan"), dtype=torch.float64)
    accuracies = collectives.allreduce_sum(torch.stack([m.get("accuracy", nan).double() for m in metrics]),
                                           name=f"hf.pp.{family}.{layout}.accuracy") / world.size
    evaluated = trainer.strategy.forward_only(trainer.step_fn, (data.tensors[0][:BATCH], data.tensors[1][:BATCH]))
    trainer.close_mesh()

    # 2 decoder layers + the embedding and the norm with the head: 4 layers over the stages.
    assert sum(stages[:pipeline * tensor:tensor]) == 4 and min(stages) >= 1
    # The keys the Trainer's step reports for this model without a pipeline (ddp's metrics.jsonl).
    reference = make_model(family, 0)
    reference.load_state_dict(final)
    unsplit = supervised_step(logits_loss)(reference, (data.tensors[0][:BATCH], data.tensors[1][:BATCH]))
    assert all(set(m) == set(unsplit[1]) == {"accuracy"} for m in metrics), metrics
    assert set(evaluated[1]) == {"accuracy"}
    assert abs(evaluated[0].item() - unsplit[0].item()) < 1e-10
    assert evaluated[1]["accuracy"].item() == unsplit[1]["accuracy"].item()
    check_against_one_process(family, data, initial, final, step_losses, BATCH * world.size // (tensor * pipeline),
                              step_accuracies=accuracies)


@pytest.mark.timeout(60)
def test_a_step_fn_is_refused_under_a_pipeline_with_the_reason(world):
    """Refused on every rank before any collective: the step needs the whole model, a stage has a part."""
    model = make_model("llama", 0)
    config = TrainConfig(epochs=1, batch_size=BATCH, pipeline_parallel=2, micro_batches=2, tensorboard=False)
    with pytest.raises(ValueError, match=r"train\.pipeline_parallel > 1 computes the loss on the last stage with "
                                         r"loss_fn\(outputs, targets\) and cannot run a step_fn, which needs the "
                                         r"whole model: pass loss_fn"):
        Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), token_data(), None, config, world=world,
                step_fn=causal_lm_step)


class PaddedWindows(torch.utils.data.Dataset):
    """A tokenized dataset's dict samples: input_ids padded on the left to SEQ (so that the real
    tokens would attend to the padding without its mask), the attention mask, and labels that are
    the ids (Hugging Face's convention: the model shifts them), -100 at padding."""

    def __init__(self, samples=64):
        generator = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, VOCAB, (samples, SEQ), generator=generator)
        self.lengths = torch.randint(3, SEQ + 1, (samples,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        mask = (torch.arange(SEQ) >= SEQ - self.lengths[index]).long()
        ids = self.ids[index] * mask
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 2, 1)], ids=["P2-M2", "T2-P2-M1"])
def test_dict_batches_with_padding_take_one_process_steps(world, layout):
    """Each stage masks the padding as the model would (the attention mask travels with the batch,
    not between stages) and the last computes Hugging Face's causal LM loss of the labels: the
    mean over each micro-batch's unpadded tokens, averaged over the micro-batches, as one process
    computes it on the same chunks."""
    tensor, pipeline, micro = layout
    if world.size != tensor * pipeline:
        pytest.skip(f"T={tensor} x P={pipeline} on exactly {tensor * pipeline} ranks (one data replica)")
    data = PaddedWindows()
    model = make_model("llama", 100 + world.rank)
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                         seed=SEED, log_every=1000, tensorboard=False, tensor_parallel=tensor,
                         pipeline_parallel=pipeline, micro_batches=micro)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world)
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    losses = record_step_losses(trainer)
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    step_losses = collectives.allreduce_sum(torch.stack(losses), name=f"hf.pp.dict.{layout}") / world.size
    trainer.close_mesh()

    reference = make_model("llama", 0)
    reference.load_state_dict(initial)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=SEED)
    sampler.set_epoch(0)
    order, expected_losses = list(sampler), []
    for step in range(STEPS):
        batch = torch.utils.data.default_collate([data[i] for i in order[step * BATCH:(step + 1) * BATCH]])
        optimizer.zero_grad()
        loss = 0
        for chunk in zip(*(batch[key].chunk(micro) for key in ("input_ids", "attention_mask", "labels"))):
            logits = reference(input_ids=chunk[0], attention_mask=chunk[1]).logits
            loss = loss + causal_lm_loss(logits, chunk[2]) / micro
        loss.backward()
        optimizer.step()
        expected_losses.append(loss.item())
    expected = reference.state_dict()
    worst = max((final[key] - expected[key]).abs().max().item() for key in expected)
    padded = sum(int((data[i]["attention_mask"] == 0).any()) for i in order[:STEPS * BATCH])

    assert padded >= STEPS, "the batches hold padding: the test checks the mask"
    assert (step_losses - torch.tensor(expected_losses, dtype=torch.float64)).abs().max() < 1e-10
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"

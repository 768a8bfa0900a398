"""Hugging Face decoders cut into pipeline stages by themselves (no pipeline_layers given), by their
own base_model_pp_plan: the model's forward up to decoder layer 0, each decoder layer, the model's
forward after the last; each stage computes the mask and rotary position embeddings its model
would. Llama (its tied embedding and head on the first and last stage), Qwen3 and Mistral take one
process's steps in float64: P=2 under 1f1b and gpipe (2 ranks), P=2 x D=2 and T=2 x P=2 (4 ranks,
the tensor split by the model's own plan). Gemma2, Granite, OLMo2 and GPT-NeoX (what they do around
their layers is their forward's own) at P=2, and the Hugging Face job (dict batches with padding and
prompts left out of the labels, no step_fn or one returning model(**batch).loss) at P=2 and
T=2 x P=2, against one process's model(**batch).loss over the whole batch, float64 throughout in
both runs (transformers' float32 casts made no-ops: hvdtrain.verify.exact). Each step's loss and
every gathered parameter to 1e-10: as in test_model_parallel.py, a pipeline changes only the order
of float64 additions (micro-batches' gradients summed, relative 1e-16 per operation, a few hundred
per step, 3 steps; measured 1e-16 to 7e-14), where a wrong cut, a step of the family's forward left
out, or a mean of micro-batch means moves values by more than 1e-4. The last stage reports the
metrics the Trainer's step reports without a pipeline (the token accuracy; a step_fn's own), in
training and evaluation, equal to one process's. What a pipeline cannot reproduce is refused before
the first step, on every rank.
"""
import copy
import math

import pytest
import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.distributed import collectives
from hvdtrain.verify.exact import float64_throughout
from hvdtrain.trainer import Trainer
from hvdtrain.components.steps import supervised_step
from tests.mpi.helpers import record_step_losses
from tests.unit.test_hf_pipeline_layers import HalvedBetweenLayers  # a Llama doing work between its layers
from tests.mpi.test_hf_equivalence import (BATCH, SEED, SEQ, STEPS, VOCAB, check_against_one_process,
                                           logits_loss, make_model, train)

transformers = pytest.importorskip("transformers")

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.np4(reason="P=2 x D=2 and T=2 x P=2 fit only at 4 ranks"),
]

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
    evaluated = trainer.strategy.forward_only(trainer.parts.step_fn, (data.tensors[0][:BATCH], data.tensors[1][:BATCH]))
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


# ---- the Hugging Face job: dict batches, the model's own loss ----------------------------------

SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=SEQ)
# Tiny families whose forward does more around its layers than embed -> norm -> head, or keeps its
# layers under another name; each one's own pipeline description cuts it (no list of names).
NEW_FAMILIES = {
    # Scaled embeddings, soft-capped attention and logits (a cap small enough to bend these logits),
    # sliding and full attention alternating over the layers, the embedding tied to the head.
    "gemma2": lambda: transformers.Gemma2Config(**SHAPE, head_dim=4, sliding_window=4, final_logit_softcapping=0.5,
                                                attn_logit_softcapping=5.0, tie_word_embeddings=True),
    # Multipliers on the embeddings, the residuals, the attention and the logits.
    "granite": lambda: transformers.GraniteConfig(**SHAPE, embedding_multiplier=3.0, logits_scaling=2.5,
                                                  residual_multiplier=0.5, attention_multiplier=0.3,
                                                  tie_word_embeddings=False),
    "olmo2": lambda: transformers.Olmo2Config(**SHAPE, tie_word_embeddings=False),
    # Its layers are gpt_neox.layers, its embedding embed_in, followed by a dropout.
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**SHAPE, tie_word_embeddings=False),
}


def build(family, seed):
    if family not in NEW_FAMILIES:
        return make_model(family, seed)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(NEW_FAMILIES[family]()).double()


class PromptWindows(torch.utils.data.Dataset):
    """Dict samples as a tokenizer and a collator give them: input_ids, an attention mask, and labels
    that are the ids (the model shifts them) with a prompt of 1 to 4 tokens left out (-100): the
    micro-batches hold different numbers of label tokens. ``padded``: each sample padded on the left
    to SEQ too (masked, -100), so that the real tokens would attend to the padding without its mask."""

    def __init__(self, padded, samples=64):
        generator = torch.Generator().manual_seed(5)
        self.ids = torch.randint(1, VOCAB, (samples, SEQ), generator=generator)
        self.lengths = torch.randint(4, SEQ + 1, (samples,), generator=generator) if padded else \
            torch.full((samples,), SEQ)
        self.prompts = torch.randint(1, 5, (samples,), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, index):
        start = SEQ - self.lengths[index]
        mask = (torch.arange(SEQ) >= start).long()
        ids = self.ids[index] * mask
        labels = ids.masked_fill(torch.arange(SEQ) < start + self.prompts[index], -100)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def padding_share(model, batch):
    """A step_fn as Hugging Face scripts write it: the model's own loss, and a metric of the batch."""
    return model(**batch).loss, {"padding": (batch["attention_mask"] == 0).double().mean()}


def train_dict_job(world, family, data, layout, step_fn=None):
    """The job under ``layout`` (tensor, pipeline, micro-batches) on one data replica, float64
    throughout: (initial and final gathered model, each step's loss, each step's metrics)."""
    tensor, pipeline, micro = layout
    model = build(family, 100 + world.rank)  # different on every rank: set-up must broadcast rank 0's
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                         seed=SEED, log_every=1000, tensorboard=False, tensor_parallel=tensor,
                         pipeline_parallel=pipeline, micro_batches=micro)
    metrics = []
    with float64_throughout():
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world,
                          **({"step_fn": step_fn} if step_fn else {}))
        initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
        losses = record_step_losses(trainer, metrics)
        trainer.fit()
        final = trainer.strategy.state_dict()["model"]
    name = f"hf.pp.job.{family}.{layout}.{step_fn is not None}"
    step_losses = collectives.allreduce_sum(torch.stack(losses), name=name) / world.size
    trainer.close_mesh()
    return initial, final, step_losses, metrics


def one_process(family, data, initial, step_fn=None):
    """The same job in one process, float64 throughout: model(**batch).loss over each whole batch."""
    reference = build(family, 0)
    reference.load_state_dict(initial)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.01)
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=SEED)
    sampler.set_epoch(0)
    order, losses, metrics = list(sampler), [], []
    with float64_throughout():
        for step in range(STEPS):
            batch = torch.utils.data.default_collate([data[i] for i in order[step * BATCH:(step + 1) * BATCH]])
            optimizer.zero_grad()
            loss, metric = (step_fn or (lambda model, batch: (model(**batch).loss, {})))(reference, batch)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            metrics.append({key: float(value) for key, value in metric.items()})
    return reference.state_dict(), losses, metrics


def check_job(family, data, initial, final, step_losses, metrics, step_fn=None):
    expected, expected_losses, expected_metrics = one_process(family, data, initial, step_fn)
    worst = max((final[key] - expected[key]).abs().max().item() for key in expected)
    moved = min((expected[key] - initial[key]).abs().max().item() for key in expected if key.endswith("weight"))
    loss_error = (step_losses - torch.tensor(expected_losses, dtype=torch.float64)).abs().max().item()
    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {step_losses.tolist()} vs {expected_losses}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"
    assert [set(m) for m in metrics] == [set(m) for m in expected_metrics], (metrics, expected_metrics)
    for seen, want in zip(metrics, expected_metrics):
        assert all(math.isclose(float(seen[key]), want[key], abs_tol=1e-12) for key in want), (seen, want)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", list(NEW_FAMILIES))
def test_families_are_cut_by_their_own_pipeline_description(world, family):
    """P=2 (2 micro-batches, 1f1b) cuts each family by its base_model_pp_plan, the first and last
    stage running the model's own forward around the layers; the Hugging Face job (dict batches,
    labels with prompts left out, no step_fn: the model's own loss) takes one process's steps.
    1e-10 for the reason of the module's docstring; float64 throughout in both runs, since these
    families' norms (and Gemma2's attention softmax) round to float32 as shipped."""
    if world.size != 2:
        pytest.skip("P=2 on exactly 2 ranks (one data replica)")
    data = PromptWindows(padded=False)
    initial, final, step_losses, metrics = train_dict_job(world, family, data, (1, 2, 2))
    check_job(family, data, initial, final, step_losses, metrics)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("with_step_fn", [False, True], ids=["no-step_fn", "loss-step_fn"])
@pytest.mark.parametrize("layout", [(1, 2, 2), (2, 2, 2)], ids=["P2-M2", "T2-P2-M2"])
def test_the_hugging_face_job_runs_unchanged_under_a_pipeline(world, layout, with_step_fn):
    """The job that runs under ddp, fsdp and T=2 (left-padded dict batches with an attention mask,
    labels -100 at padding and prompts; no step_fn, or one returning model(**batch).loss with a
    metric) at P=2 and T=2 x P=2: each stage masks the padding as the model would, the last computes
    the model's loss_function over the batch's label tokens (num_items_in_batch: the micro-batches'
    losses add up to the batch's token mean, not a mean of micro-batch means), equal to one process's
    model(**batch).loss over the whole batch; the step_fn's metric reaches every rank."""
    tensor, pipeline, micro = layout
    if world.size != tensor * pipeline:
        pytest.skip(f"T={tensor} x P={pipeline} on exactly {tensor * pipeline} ranks (one data replica)")
    data = PromptWindows(padded=True)
    step_fn = padding_share if with_step_fn else None
    initial, final, step_losses, metrics = train_dict_job(world, "llama", data, layout, step_fn)
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=SEED)
    sampler.set_epoch(0)
    order = list(sampler)[:STEPS * BATCH]

    assert sum(int((data[i]["attention_mask"] == 0).any()) for i in order) >= STEPS, "the batches hold padding"
    check_job("llama", data, initial, final, step_losses, metrics, step_fn)


def calls_the_model_twice(model, batch):
    model(**batch)
    return model(**batch).loss, {}


def reads_the_parameters(model, batch):
    return model(**batch).loss + 0 * sum(p.sum() for p in model.parameters()), {}


@pytest.mark.timeout(60)
def test_what_a_pipeline_cannot_reproduce_is_refused_before_the_first_step(world):
    """Refused on every rank alike (no rank waits in an exchange): work between decoder layers at
    set-up, by probing the forward; a step_fn doing more than model(**batch).loss in the first step,
    before any exchange, naming what it did."""
    if world.size != 2:
        pytest.skip("P=2 on exactly 2 ranks")
    config = TrainConfig(epochs=1, batch_size=BATCH, max_steps=1, pipeline_parallel=2, micro_batches=2,
                         tensorboard=False, log_every=1000)
    model = build("llama", 0)
    model.model = HalvedBetweenLayers(model.model)
    with pytest.raises(ValueError, match=r"cannot cut a 'llama' model by itself: it does work between decoder layers "
                                         r"0 and 1 \(the input of layer 1 is not what layer 0 returned\); give "
                                         r"Trainer\(\.\.\., model_plan=ModelPlan\(pipeline_layers=fn\)\)"):
        Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), PromptWindows(padded=False), None, config,
                world=world)
    for step_fn, said in [(calls_the_model_twice, r"calls the model once; this one called it 2 times"),
                          (reads_the_parameters, r"can only call model\(\*\*batch\).*this one read model\.parameters")]:
        model = build("llama", 0)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), PromptWindows(padded=False), None,
                          config, world=world, step_fn=step_fn)
        with pytest.raises(ValueError, match=said):
            trainer.fit()
        trainer.close_mesh()

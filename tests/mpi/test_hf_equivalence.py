"""Hugging Face decoders take one process's steps under every data-parallel strategy (ddp, zero1,
zero2, fsdp) and split by their own tensor-parallel plans (``model.tp_plan``: no plan given): Llama
(grouped-query attention; a tied embedding and head, cut by vocabulary rows under tensor
parallelism), Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms whose gradients are summed over the
tensor group) and Mistral, in float64, compared step by step (the loss) and at the end (every
parameter, gathered) with one process on the global batch. Tensor parallelism runs at T=2 (2 ranks),
T=2 x D=2 and T=4 (4 ranks); the strategies at every world size. Activation checkpointing (full and
selective) on Llama, Qwen3 and Mistral under fsdp, T=2 and P=2, and on Llama under T=2 x P=2.

Why 1e-10 holds on any x86-64 CPU: as in test_model_parallel.py, split products, all-reduced
partial sums and averaged gradients differ from one process's only in the order of float64
additions (relative 1e-16 per operation, a few hundred per step, 3 steps); a missing all-reduce, a
wrong slice or a broken tie moves values by more than 1e-4 (checked below by how far training moved
them).
"""
import copy

import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain.config.train import TrainConfig
from hvdtrain.data.sharding import ShardedSampler
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from hvdtrain.components.steps import class_accuracy
from hvdtrain.verify.exact import float64_throughout
from tests.mpi.helpers import record_step_losses
from tests.mpi import helpers

transformers = pytest.importorskip("transformers")

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.np1(reason="every data-parallel strategy, and T=1, at one rank"),
    pytest.mark.np4(reason="T=2 x D=2 and T=4 fit only at 4 ranks"),
]

VOCAB, SEQ, BATCH, STEPS, SEED = 64, 8, 4, 3, 7
# Grouped-query attention: 8 query heads share 4 key/value heads; every size divides by T = 2 and 4.
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, max_position_embeddings=SEQ)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, tie_word_embeddings=True),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, tie_word_embeddings=False),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=8, tie_word_embeddings=False),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, tie_word_embeddings=False, sliding_window=None),
}
# Families that do work outside their tensor plan's layers, each run float64 throughout (their norms
# compute in float32 otherwise: hvdtrain.verify.exact). Gemma2: an embedding class of its own that
# scales the lookup by sqrt(hidden), soft-capped attention and logits, 1 + weight norms, sliding and
# full attention layers in turn.
OWN_FORWARD_FAMILIES = {
    "gemma2": lambda: transformers.Gemma2Config(**SHAPE, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
                                                attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                                                tie_word_embeddings=True),
}


def make_model(family, seed):
    torch.manual_seed(seed)
    config = {**FAMILIES, **OWN_FORWARD_FAMILIES}[family]()
    return transformers.AutoModelForCausalLM.from_config(config).double()


def causal_lm_step(model, batch):
    inputs, targets = batch
    logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)), {}


def logits_loss(outputs, targets):
    """Cross-entropy of the logits (the model's output's, or a pipeline's last stage's: the logits themselves)."""
    logits = getattr(outputs, "logits", outputs)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def token_data(samples: int = 64) -> TensorDataset:
    return helpers.token_data(VOCAB, SEQ, samples)


def reference(family, initial, data, global_batch):
    """One process, no Horovod: the global batches in the sampler's global order. Returns the final
    state, each step's loss and each step's token accuracy (supervised_step's)."""
    model = make_model(family, 0)
    model.load_state_dict(initial)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    sampler = ShardedSampler(len(data), rank=0, world_size=1, seed=SEED)
    sampler.set_epoch(0)
    order = list(sampler)
    losses, accuracies = [], []
    for step in range(STEPS):
        batch = order[step * global_batch:(step + 1) * global_batch]
        optimizer.zero_grad()
        logits = model(input_ids=data.tensors[0][batch]).logits
        loss = logits_loss(logits, data.tensors[1][batch])
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        accuracies.append(class_accuracy(logits, data.tensors[1][batch]).item())
    return model.state_dict(), losses, accuracies


def train(world, family, step=None, metrics_seen=None, **settings):
    """(the trainer, the data, its initial and final gathered model, each step's loss averaged over
    the world). ``step``: the Trainer's step_fn or loss_fn (default: step_fn=causal_lm_step);
    ``metrics_seen``: a list each step's metrics (this rank's) are appended to."""
    data = token_data()
    model = make_model(family, 100 + world.rank)  # different on every rank: set-up must broadcast rank 0's
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                         seed=SEED, log_every=1000, tensorboard=False, **settings)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), data, None, config, world=world,
                      **(step or {"step_fn": causal_lm_step}))
    initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
    losses = record_step_losses(trainer, metrics_seen)
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    step_losses = collectives.allreduce_sum(torch.stack(losses), name=f"hf.{family}.{settings}.losses") / world.size
    return trainer, data, initial, final, step_losses


def check_against_one_process(family, data, initial, final, step_losses, global_batch, step_accuracies=None):
    """``step_accuracies``: each step's token accuracy averaged over the world, when the step reports it."""
    expected, expected_losses, expected_accuracies = reference(family, initial, data, global_batch)
    worst = max((final[name] - expected[name]).abs().max().item() for name in expected)
    moved = min((expected[name] - initial[name]).abs().max().item() for name in expected
                if name.endswith("weight"))
    loss_error = (step_losses - torch.tensor(expected_losses, dtype=torch.float64)).abs().max().item()
    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {step_losses.tolist()} vs {expected_losses}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"
    if step_accuracies is not None:
        # A share of argmaxes: equal unless two logits tie within 1e-10 (they do not, random init).
        accuracy_error = (step_accuracies - torch.tensor(expected_accuracies, dtype=torch.float64)).abs().max()
        assert accuracy_error < 1e-12, f"per-step accuracy: {step_accuracies.tolist()} vs {expected_accuracies}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_strategy_takes_one_process_steps(world, family, strategy):
    trainer, data, initial, final, step_losses = train(world, family, strategy=strategy)
    check_against_one_process(family, data, initial, final, step_losses, BATCH * world.size)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tensor", [2, 4])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_models_own_tensor_plan_takes_one_process_steps(world, family, tensor):
    if world.size % tensor:
        pytest.skip(f"tensor_parallel={tensor} does not divide {world.size} ranks")
    trainer, data, initial, final, step_losses = train(world, family, tensor_parallel=tensor)
    model = trainer.model
    split = sorted(name for name, p in model.named_parameters(remove_duplicate=False) if hasattr(p, "tensor_shard"))
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    trainer.close_mesh()

    assert "tensor plan: the model's own tp_plan" in trainer.strategy.plan_note
    # Every projection, the embedding and the head split; norms whole.
    assert "model.embed_tokens.weight" in split and "lm_head.weight" in split
    assert all(f"model.layers.{i}.self_attn.{p}.weight" in split for i in range(2) for p in ("q_proj", "k_proj", "o_proj"))
    assert not any("norm" in name for name in split)
    assert tied == (family == "llama"), "the tied embedding and head stay one parameter"
    check_against_one_process(family, data, initial, final, step_losses, BATCH * world.size // tensor)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tensor", [2, 4])
@pytest.mark.parametrize("family", list(OWN_FORWARD_FAMILIES))
def test_a_family_that_works_outside_its_plan_splits_as_one_process(world, family, tensor):
    """Gemma2's embedding is a class of its own (the lookup times sqrt(hidden)): split by vocabulary
    rows, its own forward still runs around the split lookup. On the main of 2026-11-25 the split
    table dropped the scale and T=2 trained silently to weights 8e-3 away from one process."""
    if world.size % tensor:
        pytest.skip(f"tensor_parallel={tensor} does not divide {world.size} ranks")
    with float64_throughout():
        trainer, data, initial, final, step_losses = train(world, family, tensor_parallel=tensor)
        embedding = type(trainer.model.get_input_embeddings()).__name__
        trainer.close_mesh()
        check_against_one_process(family, data, initial, final, step_losses, BATCH * world.size // tensor)
    assert embedding == "VocabParallelGemma2TextScaledWordEmbedding"


RECOMPUTED_LAYOUTS = {"fsdp": {"strategy": "fsdp"}, "T2": {"tensor_parallel": 2},
                      "P2": {"pipeline_parallel": 2, "micro_batches": 2},
                      "T2-P2": {"tensor_parallel": 2, "pipeline_parallel": 2, "micro_batches": 2}}
# Three families under fsdp, T=2 and P=2; T=2 x P=2 (4 ranks) on Llama alone, for the suite's time.
RECOMPUTED = [(family, layout) for family in ("llama", "qwen3", "mistral") for layout in ("fsdp", "T2", "P2")]
RECOMPUTED.append(("llama", "T2-P2"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family,layout", RECOMPUTED, ids=["-".join(case) for case in RECOMPUTED])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_takes_one_process_steps(world, family, layout, mode):
    """Every decoder layer computed again in backward (the tensor group's all-reduces, the pipeline
    stage's own layers, fsdp's gathers again): the same steps."""
    layout = RECOMPUTED_LAYOUTS[layout]
    mesh = layout.get("tensor_parallel", 1) * layout.get("pipeline_parallel", 1)
    if world.size % mesh:
        pytest.skip(f"a mesh of {mesh} does not divide {world.size} ranks")
    step = {"loss_fn": logits_loss} if "pipeline_parallel" in layout else None
    trainer, data, initial, final, step_losses = train(world, family, step=step, activation_checkpointing=mode,
                                                       **layout)
    recomputed = trainer.parts.recomputed_blocks
    if mesh > 1:
        trainer.close_mesh()

    assert recomputed == ["model.layers.0", "model.layers.1"]
    check_against_one_process(family, data, initial, final, step_losses, BATCH * world.size // mesh)


def _qwen3_plan_without(*dropped, added=None):
    plan = {key: style for key, style in make_model("qwen3", 0).tp_plan.items()
            if not any(key.endswith(d) for d in dropped)}
    return {**plan, **(added or {})}


# A plan that leaves Qwen3's per-head norms unsummed trains each rank's copy on its own heads; one that
# sums the whole-width input norm counts its gradient twice. Both train silently without the audit.
# (The split region's rule, hvdtrain.parallel.tensor.region, sums the per-head norms a plan leaves out:
# it is switched off in that case, which shows the audit still refuses what the rule would miss.)
WITHOUT_THE_SPLIT_REGION = {"per-head norm left unsummed"}
MISCOUNTED_PLANS = {
    "per-head norm left unsummed": (lambda: _qwen3_plan_without("q_norm", "k_norm"),
                                    r"the gradient of model\.layers\.0\.self_attn\.q_norm\.weight, kept whole, differs"),
    "whole-input norm summed": (lambda: _qwen3_plan_without(added={"layers.*.input_layernorm":
                                                                   "replicated_with_grad_allreduce"}),
                                r"the gradient of model\.layers\.0\.input_layernorm\.weight is summed .* counts it 2 times"),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(MISCOUNTED_PLANS))
def test_a_plan_that_counts_a_gradient_otherwise_than_once_is_refused_before_the_first_update(world, case,
                                                                                            monkeypatch):
    from hvdtrain.parallel.tensor import region as tensor_region
    from hvdtrain.parallel.model_plan import ModelPlan

    if world.size % 2:
        pytest.skip("tensor_parallel=2 needs an even number of ranks")
    if case in WITHOUT_THE_SPLIT_REGION:
        monkeypatch.setattr(tensor_region, "split_region_parameters", lambda *args, **kwargs: [])
    plan, reason = MISCOUNTED_PLANS[case]
    model = make_model("qwen3", 100)
    config = TrainConfig(epochs=1, batch_size=BATCH, lr=0.01, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                         seed=SEED, log_every=1000, tensorboard=False, tensor_parallel=2)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=0.01), token_data(), None, config, world=world,
                      step_fn=causal_lm_step, model_plan=ModelPlan(tensor_plan=plan()))
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match=reason):
        trainer.fit()
    unchanged = all(torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
    trainer.close_mesh()
    assert unchanged, "a parameter was stepped before the refusal"


@pytest.mark.timeout(120)
def test_a_split_that_computes_otherwise_is_refused_at_set_up(world, monkeypatch):
    """The probe at set-up: with Gemma2's embedding split as a plain table again (the bug fixed above,
    put back), the split model's logits on a probe are not the whole model's: refused before training."""
    from hvdtrain.parallel.tensor import layers as tensor

    if world.size % 2:
        pytest.skip("tensor_parallel=2 needs an even number of ranks")
    plain = lambda embedding, group, name: tensor.VocabParallelEmbedding(  # noqa: E731
        tensor._shard(embedding.weight, tensor.TensorShard(dim=0, parts=group.size, index=group.index)),
        embedding.padding_idx, group, name)
    monkeypatch.setattr(tensor.VocabParallelEmbedding, "from_embedding", plain)
    with pytest.raises(ValueError, match=r"found at set-up\): on a probe of 8 tokens its logits are \S+ away from "
                                         r"the whole model's"):
        train(world, "gemma2", tensor_parallel=2)

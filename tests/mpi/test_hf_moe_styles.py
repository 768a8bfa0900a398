"""transformers' packed_rowwise, moe_identity_expert and all_reduce under T=2 take one process's
steps, on the families that use them built tiny as ``hvdtrain check-layout`` builds them (float64):

- aria_text: transposed fused experts, (experts, in, out), its [gate | up] columns cut in two groups
  (packed_rowwise) and down_proj's rows (colwise);
- longcat_flash: identity (zero-computation) experts beside the routed ones, their input divided by
  the group size inside the experts' sum (moe_identity_expert); most tokens go to them here (256
  identity experts, 4 routed);
- inkling_text: shared experts on their own cut bare parameters, their output summed (all_reduce).
  Inkling's own plan is refused (it cuts the routed experts' [gate; up] rows as plain colwise, gate on
  one rank and up on the other): here its experts entry is packed_colwise, as every fused [gate; up]
  family's, so the all_reduce module trains.

2 AdamW steps, compared step by step (the loss) and at the end (every parameter, gathered) with one
process on the same batches. Bound 1e-10: the layouts differ in the order of float64 additions only
(relative 1e-16 each), while a sum counted twice, an identity expert counted once per rank or a gate
cut apart from its up column moves the weights by a fraction of how far training moved them (> 1e-4,
checked).
"""
import copy
import functools

import pytest
import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.parallel.tensor.plan import model_tensor_plan
from hvdtrain.trainer import Trainer
from hvdtrain.verify.exact import float64_throughout
from tests.mpi import helpers
from tests.mpi.helpers import causal_lm_step, record_step_losses

pytest.importorskip("transformers")
from hvdtrain.verify.tiny import SEQUENCE, build_tiny, make_model  # noqa: E402

# Left out of the Gloo launch at $NP ranks of scripts/run_tests.sh, with the reason (setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.skip_gloo(reason="the expert styles' splits use the tensor group's collectives that test_hf_moe runs "
                                 "under Gloo"),
]

BATCH, STEPS, SEED, LR = 4, 2, 7, 0.01
INKLING_EXPERTS = "model.layers.*.mlp.experts.gate_up_proj"


@functools.lru_cache(maxsize=None)
def tiny_config(family):
    built = build_tiny(family)
    assert built.built, built.reason
    return built.config


def plan_of(family, model):
    plan = model_tensor_plan(model)
    if family == "inkling_text":
        plan[INKLING_EXPERTS] = "packed_colwise"  # see the module's docstring
    return plan


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["aria_text", "longcat_flash", "inkling_text"])
def test_a_family_using_the_style_takes_one_process_steps_at_t2(world, family):
    if world.size != 2:
        pytest.skip("T=2 with one data rank: a 2-rank world")
    config = tiny_config(family)
    data = helpers.token_data(config.vocab_size, SEQUENCE, samples=32)
    with float64_throughout():
        model = make_model(config, seed=100 + world.rank)  # set-up must broadcast rank 0's
        settings = TrainConfig(epochs=1, batch_size=BATCH, lr=LR, scale_lr=False, warmup_epochs=0, max_steps=STEPS,
                               seed=SEED, log_every=1000, tensorboard=False, tensor_parallel=2)
        trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=LR), data, None, settings, world=world,
                          step_fn=causal_lm_step, model_plan=ModelPlan(tensor_plan=plan_of(family, model)))
        initial = copy.deepcopy(trainer.strategy.state_dict()["model"])
        losses = record_step_losses(trainer)
        trainer.fit()
        final = trainer.strategy.state_dict()["model"]
        split = {name for name, p in trainer.model.named_parameters() if hasattr(p, "tensor_shard")}
        step_losses = collectives.allreduce_sum(torch.stack(losses), name=f"styles.{family}.losses") / world.size
        trainer.close_mesh()
        reference = make_model(config, seed=0)  # the one data rank of T=2 takes each step's batch whole
        reference.load_state_dict(initial)
        expected, expected_losses = helpers.one_process_adamw(reference, data, BATCH, STEPS, lr=LR, seed=SEED)

    worst = max((final[name] - expected[name]).abs().max().item() for name in expected)
    moved = min((expected[name] - initial[name]).abs().max().item() for name in expected if ".experts." in name)
    loss_error = (step_losses - torch.tensor(expected_losses, dtype=torch.float64)).abs().max().item()
    print(f"\n{family} T2: max |param - one process| {worst:.2e}, loss {loss_error:.2e}, experts moved >= {moved:.2e}")

    assert set(final) == set(expected)
    assert any(".experts." in name for name in split), "the experts were not split: the test proves nothing"
    if family == "inkling_text":
        assert "model.layers.0.mlp.shared_experts.down_proj" in split  # the all_reduce module's own parameters
    assert moved > 1e-4, "training did not move every expert's weights: the test proves nothing"
    assert loss_error < 1e-10 and worst < 1e-10, (loss_error, worst)

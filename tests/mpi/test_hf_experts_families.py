"""Expert parallelism (train.expert_parallel=2, over ddp) on every mixture-of-experts family of the
installed transformers whose fused experts hvdtrain splits: each built tiny by hvdtrain.verify.tiny
(4 experts, top-2, float64, the eager experts), trained 2 AdamW steps at E=2 and by one process on
the same global batches, equal within 1e-10 (the bound and its reasons: test_hf_moe.py's).
test_hf_experts.py checks Qwen2-MoE, Qwen3-MoE and Mixtral in more layouts; this file checks the
families' own ways of calling their experts.

Most call ``experts(hidden_states, top_k_index, top_k_weights)``. Two do not, and crashed in the
dispatch with a raw TypeError (``_Dispatch.__call__() missing ... required positional argument``)
until it learned their calls: JetMoe's JetMoeParallelExperts (a linear map per expert, in its MLP and
its mixture of attention heads) is called with rows already sorted by expert and each expert's count,
``experts(rows, expert_size)``; Llama 4's Llama4TextExperts with every token once per expert,
expert-major, ``experts(rows)``. The families were found by building every causal-LM family of
transformers 5.24 tiny and keeping those with a fused experts module (hvdtrain.parallel.experts.
fused_experts); dbrx and the multimodal ones (llama4, qwen3_5_moe, qwen4_exp, dots3_note) do not build
tiny, their text towers are here.
"""
import os

import pytest
import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.trainer import Trainer
from hvdtrain.verify import reference
from hvdtrain.verify.exact import float64_throughout
from hvdtrain.verify.outcome import TOLERANCE
from tests.mpi.helpers import record_step_losses

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets,
              pytest.mark.np4(reason="the row dispatch's families with two replica groups of each expert")]

STEPS, SEED = 2, 7
# Called otherwise than experts(hidden_states, top_k_index, top_k_weights): dispatched by rows.
ROWS = ["jetmoe", "llama4_text"]
ROUTED = ["afmoe", "aria_text", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v2", "deepseek_v3",
          "deepseek_v32", "deepseek_v4", "dots1", "dots3_note_text", "ernie4_5_moe", "exaone_moe", "flex_olmo",
          "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa", "granitemoehybrid",
          "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling2_loop_text", "inkling2_text",
          "inkling_text", "jamba", "kimi_linear", "kolibri1", "laguna", "lara_mini", "lfm2_moe", "mellum",
          "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "mixtral", "nemotron_h", "olmoe", "phimoe",
          "qwen2_moe", "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen4_exp_text", "sarvam_mla", "sarvam_moe",
          "solar_open"]

# CI runs a fixed slice of the routed families (each a different experts class or routing: shared
# experts and grouped routing, biases and sinks, a hybrid, linear attention, dense-first layers);
# HVDTRAIN_EVERY_FAMILY=1 runs all 55 (2.3 min at 2 ranks; the last run's figures:
# docs/concepts/model-parallelism.md, expert parallelism).
CI_SLICE = ["deepseek_v3", "gpt_oss", "granitemoe", "jamba", "minimax", "qwen3_next"]
FAMILIES = ROWS + (ROUTED if os.environ.get("HVDTRAIN_EVERY_FAMILY") == "1" else CI_SLICE)


def tiny_family(family):
    from hvdtrain.verify.tiny import build_tiny

    tiny = build_tiny(family)
    if not tiny.built:
        pytest.skip(f"{family} does not build tiny here: {tiny.reason}")
    return tiny.config


def train_at_e2(world, config):
    """(initial and final gathered state, each step's world-mean loss, this rank's split expert
    parameters' names and shapes) of the family trained at E=2."""
    from hvdtrain.verify.tiny import SEQUENCE, make_model

    data = reference.token_data(config.vocab_size, SEQUENCE)
    model = make_model(config, seed=100 + world.rank)  # set-up must broadcast rank 0's
    settings = TrainConfig(epochs=1, batch_size=reference.BATCH, lr=reference.RATES["adamw"], scale_lr=False,
                           warmup_epochs=0, max_steps=STEPS, seed=SEED, log_every=10**6, progress="off",
                           tensorboard=False, stall_timeout=0, expert_parallel=2)
    trainer = Trainer(model, reference.make_optimizer("adamw", model.parameters()), data, None, settings, world=world,
                      loss_fn=reference.logits_loss)
    initial = {name: t.detach().clone() for name, t in trainer.strategy.state_dict()["model"].items()}
    losses = record_step_losses(trainer)
    trainer.fit()
    final = trainer.strategy.state_dict()["model"]
    held = {name: tuple(p.shape) for name, p in trainer.model.named_parameters() if hasattr(p, "expert_shard")}
    trainer.close_mesh()
    step_losses = collectives.allreduce_sum(torch.stack(losses), name=f"families.{config.model_type}.losses")
    return data, initial, final, (step_losses / world.size).tolist(), held


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_moe_family_takes_one_process_steps_at_e2(world, family):
    from hvdtrain.verify.tiny import make_model

    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    if world.size > 2 and family not in ROWS:
        pytest.skip("past 2 ranks only the row dispatch's families (with two replica groups of each expert)")
    config = tiny_family(family)
    with float64_throughout():
        data, initial, final, step_losses, held = train_at_e2(world, config)
        expected, expected_losses = reference.one_process(make_model(config, seed=0), initial, data, SEED,
                                                          reference.BATCH * world.size, STEPS, "adamw")
    found = reference.compare(final, expected, initial, step_losses, expected_losses, TOLERANCE)
    experts_moved = min((expected[name] - initial[name]).abs().max().item() for name in held)
    print(f"\n{family} E=2 at {world.size} ranks: max |param - one process| {found.max_diff:.2e}, "
          f"max |loss - one process| {found.loss_diff:.2e}, experts moved >= {experts_moved:.2e}")

    assert held, "no expert parameter was split"
    assert experts_moved > 1e-4, "training did not move every expert: the test proves nothing"
    assert found.loss_diff < TOLERANCE, f"per-step loss against one process: {found.loss_diff}"
    assert found.max_diff < TOLERANCE, f"{found.parameter}: |gathered - one process| = {found.parameter_diff}"
    for name, shape in held.items():  # half of the experts each, gathered whole under the model's names
        assert shape[0] * 2 == final[name].shape[0] and shape[1:] == tuple(final[name].shape[1:]), name

"""Hugging Face decoders cut into pipeline stages by themselves (no pipeline_layers given): the
embedding, each decoder layer, the norm with the head; each stage computes the mask and rotary
position embeddings its model would. Llama (its tied embedding and head on the first and last
stage), Qwen3 and Mistral take one process's steps in float64: P=2 under 1f1b and gpipe (2 ranks),
P=2 x D=2 and T=2 x P=2 (4 ranks, the tensor split by the model's own plan), each step's loss and
every gathered parameter to 1e-10 (the bound of test_model_parallel.py, for the same reason).
"""
import pytest

from hvdtrain.distributed import collectives
from tests.mpi.test_hf_equivalence import BATCH, check_against_one_process, logits_loss, train

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
    trainer, data, initial, final, step_losses = train(
        world, family, step={"loss_fn": logits_loss}, tensor_parallel=tensor, pipeline_parallel=pipeline,
        pipeline_schedule=schedule, micro_batches=micro)
    stages = collectives.allgather_object(len(trainer.strategy.pipeline.module.layers),
                                          name=f"hf.pp.{family}.{layout}.layers")
    trainer.close_mesh()

    # 2 decoder layers + the embedding and the norm with the head: 4 layers over the stages.
    assert sum(stages[:pipeline * tensor:tensor]) == 4 and min(stages) >= 1
    check_against_one_process(family, data, initial, final, step_losses, BATCH * world.size // (tensor * pipeline))

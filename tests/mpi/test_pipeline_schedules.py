"""The schedules with less bubble compute what one process does: the interleaved 1F1B (v chunks per
stage, chunk g on stage g % P) and the zero-bubble ZB-H1 (backward split into the input's gradient
and, later, the weights'). P stages (times D data groups) take STEPS Adam steps of the example
transformer beside one process holding the whole model and the whole batch, in float64.

The bound, 1e-10: both schedules sum the same products as one process's backward, in another order
(micro-batch by micro-batch; ZB-H1 layer by layer), so they differ by float64 rounding (about 1e-16
relative, grown by three Adam steps to about 1e-14 here); a wrong order, a gradient missed or counted
twice would show as differences of 1e-3 and more."""
import pytest
import torch

from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.examples.textlm_parallel import pipeline_layers
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.pipeline.schedule import PipelineStage, run_schedule, split_micro_batches
from tests.mpi.helpers import agreed
from tests.mpi.pipeline_steps import pipeline_beside_one_process

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.timeout(300),
    pytest.mark.np4(reason="P=4 and P=2 x D=2 fit only at 4 ranks"),
]

VOCAB, SEQ, WIDTH, HEADS, BLOCKS = 20, 8, 16, 2, 6  # 8 pipeline layers: P x v up to 8 chunks
ROWS = 8  # sequences per pipeline and step
STEPS = 3
TOLERANCE = 1e-10


def make_model() -> TinyTransformerLM:
    torch.manual_seed(11)
    return TinyTransformerLM(VOCAB, seq_len=SEQ, d_model=WIDTH, layers=BLOCKS, heads=HEADS, dropout=0.0).double()


def global_batch(step: int, rows: int):
    generator = torch.Generator().manual_seed(300 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def steps_beside_one_process(mesh: Mesh, schedule: str, virtual: int, micro_batches: int, tag: str):
    """Per step [|loss difference|, largest gradient difference, largest parameter difference after the
    step] against one process, and the most micro-batch chunks this stage held at once."""
    model, reference = make_model(), make_model()
    stage = PipelineStage(pipeline_layers(model), mesh, virtual=virtual)
    rows, _ = pipeline_beside_one_process(stage, model, reference, mesh, schedule, micro_batches, global_batch, ROWS,
                                          STEPS, tag)
    return rows, stage.stats.max_in_flight


CASES = [  # (schedule, P, v, M)
    ("1f1b", 2, 2, 2), ("1f1b", 2, 2, 4), ("1f1b", 2, 3, 4), ("1f1b", 2, 4, 8),
    ("zb-h1", 2, 1, 1), ("zb-h1", 2, 1, 4), ("zb-h1", 2, 1, 8),
    ("1f1b", 4, 2, 4), ("1f1b", 4, 2, 8), ("zb-h1", 4, 1, 2), ("zb-h1", 4, 1, 8),
]


@pytest.mark.parametrize("schedule,pipeline,virtual,micro_batches", CASES)
def test_schedule_takes_the_steps_of_one_process(world, schedule, pipeline, virtual, micro_batches):
    if world.size % pipeline:
        pytest.skip(f"{pipeline} stages do not fit a world of {world.size}")
    mesh = Mesh.build(world.size, world.rank, pipeline=pipeline)
    tag = f"sched.{schedule}.{pipeline}.{virtual}.{micro_batches}"
    try:
        rows, held = steps_beside_one_process(mesh, schedule, virtual, micro_batches, tag)
        table = agreed(rows, f"{tag}.rows").reshape(world.size, STEPS, 3)
        helds = agreed([held], f"{tag}.held")
    finally:
        mesh.close()
    worst = table.amax(dim=(0, 1))
    where = f"{schedule}, P={pipeline}, v={virtual}, M={micro_batches}"
    assert worst[1] < TOLERANCE, f"{where}: gradients differ from one process's by {worst[1]:.3g}"
    assert worst[0] < TOLERANCE, f"{where}: loss differs from one process's by {worst[0]:.3g}"
    assert worst[2] < TOLERANCE, f"{where}: parameters after {STEPS} Adam steps differ by {worst[2]:.3g}"
    if schedule == "zb-h1":  # 1F1B's memory: no stage holds more than P micro-batches
        assert int(helds.max()) <= pipeline, f"{where}: a stage held {int(helds.max())} micro-batches"


def test_interleaving_refuses_micro_batches_not_a_multiple_of_p(world):
    if world.size % 2:
        pytest.skip("2 stages do not fit")
    mesh = Mesh.build(world.size, world.rank, pipeline=2)
    try:
        stage = PipelineStage(pipeline_layers(make_model()), mesh, virtual=2)
        inputs, targets = global_batch(0, 3)
        with pytest.raises(ValueError, match="micro_batches a multiple of pipeline_parallel=2"):
            run_schedule("1f1b", stage, mesh, split_micro_batches((inputs, targets), 3), lm_loss)
    finally:
        mesh.close()


# ---- through the Trainer: a Hugging Face Llama cut by its own plan ----------------------------

# (schedule, virtual stages, micro-batches) at P=2: Llama's 4 pipeline layers (the embedding, 2
# decoder layers, the norm with the tied head) make 4 chunks of one layer under v=2.
HF_LAYOUTS = [("1f1b", 2, 2), ("zb-h1", 1, 2)]


@pytest.mark.parametrize("schedule,virtual,micro_batches", HF_LAYOUTS)
def test_a_hugging_face_llama_takes_one_process_steps(world, schedule, virtual, micro_batches):
    """train.pipeline_schedule / train.pipeline_virtual_stages through the Trainer: each step's loss,
    every gathered parameter after the steps and the evaluation's loss and accuracy, one process's."""
    pytest.importorskip("transformers")
    from hvdtrain.components.steps import supervised_step
    from tests.mpi.test_hf_equivalence import BATCH, check_against_one_process, logits_loss, make_model, train

    if world.size % 2:
        pytest.skip("2 stages do not fit")
    trainer, data, initial, final, step_losses = train(
        world, "llama", step={"loss_fn": logits_loss}, pipeline_parallel=2, pipeline_schedule=schedule,
        micro_batches=micro_batches, pipeline_virtual_stages=virtual)
    held = agreed([len(trainer.strategy.pipeline.module.chunks)], f"hf.sched.{schedule}.{virtual}.chunks")
    evaluated = trainer.strategy.forward_only(trainer.parts.step_fn, (data.tensors[0][:BATCH], data.tensors[1][:BATCH]))
    trainer.close_mesh()
    assert held.flatten().tolist() == [virtual] * world.size
    reference = make_model("llama", 0)
    reference.load_state_dict(final)
    unsplit = supervised_step(logits_loss)(reference, (data.tensors[0][:BATCH], data.tensors[1][:BATCH]))
    assert abs(evaluated[0].item() - unsplit[0].item()) < TOLERANCE
    assert evaluated[1]["accuracy"].item() == unsplit[1]["accuracy"].item()
    check_against_one_process("llama", data, initial, final, step_losses, BATCH * world.size // 2)

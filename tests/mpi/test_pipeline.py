"""Pipeline parallelism is right when P stages (times D data-parallel pipelines) compute the same
loss and gradients as one process with the whole model and the whole global batch, whatever the
schedule and the number of micro-batches, and stay equal through optimizer steps (the tied
embedding's two copies included); and when 1F1B holds at most P micro-batches' activations.

Every layout runs at any world size it fits (P stages dividing the world, D = world / P data
groups); the others skip on every rank alike."""
import pytest
import torch

from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.examples.textlm_parallel import pipeline_layers
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.pipeline.p2p import exchange
from hvdtrain.parallel.pipeline.schedule import PipelineStage, run_schedule, split_micro_batches
from tests.mpi.helpers import agreed
from tests.mpi.pipeline_steps import pipeline_beside_one_process

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.timeout(240),
    pytest.mark.np1(reason="the layouts that fit one rank (P=1); the others skip alike"),
    pytest.mark.np4(reason="P=4 and P=2 x D=2 fit only at 4 ranks"),
    pytest.mark.gloo_np4(reason="the mesh's process sets over Gloo: 4 ranks fit every layout, and Gloo's dynamic "
                                "process sets are another implementation of the groups"),
]

VOCAB, SEQ, WIDTH, HEADS, BLOCKS = 20, 16, 32, 4, 3  # 5 pipeline layers: up to 5 stages
ROWS = 4  # sequences per pipeline and step (every M in {1, 2, 4} divides it)
STEPS = 3
TOLERANCE = 1e-10


def make_model() -> TinyTransformerLM:
    torch.manual_seed(7)
    return TinyTransformerLM(VOCAB, seq_len=SEQ, d_model=WIDTH, layers=BLOCKS, heads=HEADS, dropout=0.0).double()


def global_batch(step: int, rows: int):
    """The same (inputs, targets) on every rank: ``rows`` random windows of SEQ + 1 tokens."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=generator)
    return ids[:, :-1], ids[:, 1:]


def layout(world, pipeline: int) -> Mesh:
    if world.size % pipeline or pipeline > BLOCKS + 2:
        pytest.skip(f"{pipeline} pipeline stages do not fit a world of {world.size} (and {BLOCKS + 2} layers)")
    return Mesh.build(world.size, world.rank, pipeline=pipeline)


MICRO_BATCHES = (1, 2, 4)


def pipeline_steps(mesh: Mesh, schedule: str, micro_batches: int, tag: str):
    """STEPS Adam steps of the pipeline beside one process's full model on the whole global batch:
    per step, [|loss difference|, largest gradient difference, largest parameter difference after
    the step] (this rank's parameters, matched to the full model's by name); and the names of this
    stage's parameters and of its tied ones."""
    model, reference = make_model(), make_model()
    stage = PipelineStage(pipeline_layers(model), mesh)
    rows, names = pipeline_beside_one_process(stage, model, reference, mesh, schedule, micro_batches, global_batch,
                                              ROWS, STEPS, tag)
    return rows, [names[id(p)] for p in stage.parameters()], [names[id(p)] for p in stage.tied]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pipeline", [1, 2, 4])
def test_pipeline_takes_the_steps_of_one_process(world, pipeline, schedule):
    """P stages x D = world / P data groups, M = 1, 2, 4 micro-batches, each from the same start."""
    mesh = layout(world, pipeline)
    tables, held, tied = [], [], []
    try:
        for micro_batches in MICRO_BATCHES:
            tag = f"pipeline.{pipeline}.{schedule}.{micro_batches}"
            rows, held, tied = pipeline_steps(mesh, schedule, micro_batches, tag)
            tables.append(agreed(rows, f"{tag}.rows").reshape(world.size, STEPS, 3))
        counts = agreed([len(held)], f"pipeline.{pipeline}.{schedule}.counts")
    finally:
        mesh.close()

    for micro_batches, table in zip(MICRO_BATCHES, tables):
        worst = table.amax(dim=(0, 1))
        where = f"{schedule}, {pipeline} stages, {micro_batches} micro-batches"
        assert worst[1] < TOLERANCE, f"{where}: gradients differ from one process's by {worst[1]:.3g}"
        assert worst[0] < TOLERANCE, f"{where}: loss differs from one process's by {worst[0]:.3g}"
        assert worst[2] < TOLERANCE, f"{where}: parameters after {STEPS} Adam steps differ by {worst[2]:.3g}"
    # Every parameter is on some stage; the tied matrix is tied exactly on the first and last stage.
    expected_tied = 1 if pipeline > 1 and mesh.stage in (0, pipeline - 1) else 0
    assert tied == ["token.weight"] * expected_tied
    assert int(counts.sum()) == parameters_held(make_model(), pipeline, world.size)


def parameters_held(model, pipeline: int, world_size: int) -> int:
    """How many parameter tensors all ranks hold together: each once per data group, the tied
    one twice per pipeline when P > 1."""
    per_pipeline = len(list(model.parameters())) + (1 if pipeline > 1 else 0)
    return per_pipeline * (world_size // pipeline)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_1f1b_holds_at_most_p_micro_batches(world, schedule):
    pipeline = world.size
    mesh = layout(world, pipeline)
    micro_batches = max(4, 2 * pipeline)
    try:
        stage = PipelineStage(pipeline_layers(make_model()), mesh)
        inputs, targets = global_batch(0, micro_batches)
        run_schedule(schedule, stage, mesh, split_micro_batches((inputs, targets), micro_batches), lm_loss)
        stats = stage.stats
        table = agreed([mesh.stage, stats.max_in_flight, stats.compute_s, stats.wait_s], f"held.{schedule}")
    finally:
        mesh.close()

    first = table[table[:, 0] == 0][0]
    expected = pipeline if schedule == "1f1b" else micro_batches
    assert int(first[1]) == expected, f"{schedule} held {int(first[1])} micro-batches on stage 0, expected {expected}"
    assert (table[:, 1] <= (pipeline if schedule == "1f1b" else micro_batches)).all()
    assert (table[:, 2] > 0).all() and (table[:, 3] >= 0).all()  # compute_s, wait_s recorded


CASES = [((), torch.float64), ((5,), torch.int64), ((2, 3, 4), torch.float32), ((0, 7), torch.float64),
         ((2, 1, 1, 2, 1, 3), torch.bfloat16), ((3,), torch.bool)]


def test_exchange_moves_any_shape_and_dtype_both_ways(world):
    mesh = layout(world, 2)
    results = []
    try:
        pair = mesh.next_pair or mesh.prev_pair
        lower, peer = pair.index == 0, pair.ranks[1 - pair.index]

        def payload(shape, dtype, rank):
            return (torch.arange(int(torch.Size(shape).numel())) + 10 * rank).reshape(shape).to(dtype)

        for number, (shape, dtype) in enumerate(CASES):
            mine = payload(shape, dtype, world.rank)
            # One way: the lower stage sends; then both ways, the upper stage's tensor a float64 of another shape.
            one_way = exchange(pair, mine if lower else None, f"p2p.{number}.one")
            other = torch.full((3, 2), float(world.rank), dtype=torch.float64)
            both = exchange(pair, mine if lower else other, f"p2p.{number}.both")
            expected = payload(shape, dtype, peer)
            same = lambda got, want: got is not None and got.dtype == want.dtype and torch.equal(got, want)
            results += [one_way is None if lower else same(one_way, expected),
                        same(both, torch.full((3, 2), float(peer), dtype=torch.float64) if lower else expected)]
        table = agreed([float(x) for x in results], "p2p.results")
    finally:
        mesh.close()
    assert (table == 1).all(), f"exchange results per rank (one way, both ways per case): {table.tolist()}"

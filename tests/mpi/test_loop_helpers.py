"""What a loop of your own reaches for, as Accelerate and Fabric offer it: gather and reduce your
metrics over every rank, print on rank 0, a barrier, rank 0 first, and log(dict) into the run's
records. At 1, 2 and 4 ranks: each rank contributes values that name it, so a result taken from the
wrong rank, in the wrong order or counted twice shows.
"""
import json
import time

import pytest
import torch

import hvdtrain
from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from tests.mpi.helpers import small_mlp, synthetic_classification

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank: every helper returns its own values"),
    pytest.mark.np4(reason="uneven gathers and reductions over 4 ranks"),
]


@pytest.fixture(scope="module")
def session(world, tmp_path_factory):
    run_dir = collectives.broadcast_object(str(tmp_path_factory.mktemp("runs")), 0, "loop_helpers.run_dir")
    model = small_mlp(3)
    config = TrainConfig(epochs=1, batch_size=4, log_every=1000, run_dir=run_dir, run_name="helpers",
                         progress="off")
    return hvdtrain.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          synthetic_classification(samples=64), config, world=world)


def test_gather_concatenates_every_ranks_rows_in_rank_order_uneven_counts_too(world, session):
    n = world.size
    mine = torch.full((world.rank + 1, 2), float(world.rank))  # rank r holds r + 1 rows of r
    gathered = session.gather({"rows": mine, "count": torch.tensor(world.rank + 1),
                               "pair": [torch.tensor([world.rank]), torch.tensor([10 * world.rank])]})
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(n)])
    assert torch.equal(gathered["rows"], expected)
    assert gathered["count"].tolist() == list(range(1, n + 1))  # a number: one row per rank
    assert gathered["pair"][0].tolist() == list(range(n)) and gathered["pair"][1].tolist() == [10 * r for r in range(n)]


@pytest.mark.parametrize("op,expected", [
    ("mean", lambda n: (n - 1) / 2), ("sum", lambda n: n * (n - 1) / 2),
    ("max", lambda n: n - 1), ("min", lambda n: 0),
])
def test_reduce_combines_every_ranks_values(world, session, op, expected):
    n = world.size
    got = session.reduce({"float": torch.tensor([float(world.rank), 1.0]), "int": torch.tensor([world.rank])}, op=op)
    assert got["float"].tolist() == [expected(n), {"mean": 1.0, "sum": float(n), "max": 1.0, "min": 1.0}[op]]
    # Integers: a mean is taken in floats (Horovod's integer average would floor it), the rest exactly.
    assert got["int"].tolist() == [expected(n)] and (got["int"].is_floating_point() == (op == "mean"))


def test_a_bad_reduction_or_a_value_that_is_no_tensor_is_refused_saying_what_to_do(session):
    with pytest.raises(ValueError, match="reduce\\(op='median'\\): choose one of mean, sum, max, min"):
        session.reduce(torch.ones(1), op="median")
    with pytest.raises(TypeError, match="make it a tensor first"):
        session.gather({"accuracy": 0.5})


def test_print_speaks_on_rank_zero_only(world, session, capsys):
    session.print("hello from", world.rank)
    out = capsys.readouterr().out
    said = collectives.allgather_object(out, name="loop_helpers.print")
    assert said == ["hello from 0\n"] + [""] * (world.size - 1)
    assert session.is_main_process == (world.rank == 0)


def test_rank_zero_runs_the_block_first_and_the_barrier_holds_every_rank(world, session):
    with session.main_process_first():
        entered = time.monotonic()
        if world.rank == 0:
            time.sleep(0.5)  # the others must not enter before rank 0 has left
        left = time.monotonic()
    times = collectives.allgather_object((entered, left), name="loop_helpers.first")
    assert all(times[r][0] >= times[0][1] for r in range(1, world.size)), times
    before = time.monotonic()
    if world.rank == world.size - 1:
        time.sleep(0.3)
    session.barrier()
    waited = collectives.allgather_object(time.monotonic() - before, name="loop_helpers.barrier")
    # Every rank waited for the last one: the ranks left the gather above up to a few ms apart (3 ms
    # measured under load), so a rank's own wait is the 0.3 s less that skew; without the barrier it
    # would be about 0.
    assert min(waited) >= 0.2, waited


def test_log_writes_a_record_into_the_runs_metrics(world, session):
    session.log({"my_accuracy": torch.tensor(0.75), "epoch_seconds": 3}, step=7)
    session.log({"tokens": 100})  # the steps taken so far: none yet
    with pytest.raises(ValueError, match="a tensor of 3 elements"):
        session.log({"vector": torch.ones(3)})
    session.barrier()
    if world.rank == 0:
        lines = (session.parts.reporter.path / "metrics.jsonl").read_text().splitlines()
        logged = [json.loads(line) for line in lines if json.loads(line).get("kind") == "log"]
        assert [(r["step"], r.get("my_accuracy"), r.get("epoch_seconds"), r.get("tokens")) for r in logged] == \
            [(7, 0.75, 3, None), (0, None, None, 100)], logged

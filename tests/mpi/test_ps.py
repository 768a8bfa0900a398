"""The parameter server (strategy=ps): the same steps as one process on the global batch (so as
ddp), with 1 or 2 servers, SGD with momentum and Adam, clipped or not; the full optimizer state as
one process holds it, so checkpoints switch between ps and ddp (tested in test_strategies.py); the bytes each rank moves, counted
by the strategy, equal the formula; a server holds the optimizer state of its slice only."""
import copy

import pytest
import torch
import torch.nn.functional as F

from hvdtrain.distributed import collectives
from hvdtrain.config.train import TrainConfig
from hvdtrain.strategies import build_strategy
from tests.mpi.helpers import flat_parameters, small_mlp, synthetic_classification
from tests.mpi.test_strategies import train

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank is its own single server"),
    pytest.mark.np4(reason="the servers' slices change with the world size; 2 servers beside 2 workers at 4"),
    pytest.mark.gloo_np4(reason="the same servers at 4 ranks over Gloo"),
]

OPTIMIZERS = {
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}
BATCH, SEED = 4, 11  # samples per rank per step


def ps_config(servers, fp16_allreduce=False):
    return TrainConfig(strategy="ps", ps_servers=servers, fp16_allreduce=fp16_allreduce)


def servers_or_skip(world, servers):
    if servers > world.size:  # the same verdict on every rank: nothing waits in a collective
        pytest.skip(f"ps_servers={servers} needs at least {servers} ranks, this launch has {world.size}")


def global_batches(data, world_size, steps):
    """The same global batches for every run: a fixed permutation, world_size * BATCH at a time."""
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(SEED))
    size = BATCH * world_size
    assert steps * size <= len(data), "the test ran out of samples: shrink it"
    return [order[step * size:(step + 1) * size] for step in range(steps)]


def ps_steps(strategy, data, batches, rank, max_norm=None):
    """The Trainer's loop by hand, on this rank's quarter of each global batch."""
    inputs, labels = data.tensors
    for batch in batches:
        mine = batch[rank * BATCH:(rank + 1) * BATCH]
        strategy.zero_grad()
        strategy.backward(F.cross_entropy(strategy.model(inputs[mine]), labels[mine]))
        strategy.synchronize()
        if max_norm is not None:
            strategy.clip_grad_norm_(max_norm)
        strategy.step()


def one_process(initial, make_optimizer, data, batches, max_norm=None, optimizer_state=None):
    """No Horovod: one model, each global batch whole."""
    model = small_mlp(seed=0)
    model.load_state_dict(initial)
    optimizer = make_optimizer(model.parameters())
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    inputs, labels = data.tensors
    for batch in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(inputs[batch]), labels[batch]).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
    return model, optimizer


def state_difference(ours, theirs) -> float:
    """Largest difference between two optimizer state_dicts (inf if their structure differs)."""
    if ours["param_groups"] != theirs["param_groups"] or sorted(ours["state"]) != sorted(theirs["state"]):
        return float("inf")
    worst = 0.0
    for index, state in theirs["state"].items():
        if sorted(ours["state"][index]) != sorted(state):
            return float("inf")
        for key, value in state.items():
            worst = max(worst, float((ours["state"][index][key].double() - value.double()).abs().max()))
    return worst


@pytest.mark.parametrize("max_norm", [None, 0.05])
@pytest.mark.parametrize("servers", [1, 2])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_ps_takes_one_process_steps_on_the_global_batch(world, optimizer_name, servers, max_norm):
    """Parameters and the gathered optimizer state after 5 steps, on every rank, within 1e-10 of one
    process with the global batch (clipping: the norm summed over the servers' slices)."""
    servers_or_skip(world, servers)
    data, make_optimizer = synthetic_classification(samples=192), OPTIMIZERS[optimizer_name]
    batches = global_batches(data, world.size, steps=5)
    model = small_mlp(seed=100 + world.rank)  # different on every rank: set-up must fix that
    strategy = build_strategy(ps_config(servers), model, make_optimizer(model.parameters()), world)
    strategy.broadcast_from_root()
    initial = copy.deepcopy(strategy.state_dict()["model"])
    ps_steps(strategy, data, batches, world.rank, max_norm)
    gathered = strategy.state_dict()["optimizer"]

    expected, reference = one_process(initial, make_optimizer, data, batches, max_norm)
    difference = (flat_parameters(model) - flat_parameters(expected)).abs().max()
    moved = (flat_parameters(model) - torch.cat([v.reshape(-1) for v in initial.values()])).abs().max()
    state = torch.tensor(state_difference(gathered, reference.state_dict()), dtype=torch.float64)
    name = f"ps.equiv.{optimizer_name}.{servers}.{max_norm}"
    everywhere = collectives.allgather_rows(torch.stack([difference, moved, state]), name=name)

    assert (everywhere[:, 1] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, 0] < 1e-10).all(), f"max |ps - one process| per rank: {everywhere[:, 0].tolist()}"
    assert (everywhere[:, 2] < 1e-10).all(), f"optimizer state vs one process per rank: {everywhere[:, 2].tolist()}"


@pytest.mark.parametrize("servers", [1, 2])
def test_ps_resumes_one_process_state_and_continues_as_it_would(world, servers):
    """A full state (one process's, as ddp writes it) loaded under ps continues bitwise-close."""
    servers_or_skip(world, servers)
    data, make_optimizer = synthetic_classification(samples=192), OPTIMIZERS["adam"]
    batches = global_batches(data, world.size, steps=5)
    initial = small_mlp(seed=0).state_dict()
    halfway, optimizer = one_process(initial, make_optimizer, data, batches[:3])
    expected, _ = one_process(initial, make_optimizer, data, batches)

    model = small_mlp(seed=55)
    strategy = build_strategy(ps_config(servers), model, make_optimizer(model.parameters()), world)
    strategy.broadcast_from_root()
    strategy.load_state_dict({"model": halfway.state_dict(), "optimizer": optimizer.state_dict()})
    ps_steps(strategy, data, batches[3:], world.rank)
    difference = (flat_parameters(model) - flat_parameters(expected)).abs().max()
    rows = collectives.allgather_rows(difference.reshape(1), name=f"ps.resume.{servers}")
    assert (rows < 1e-10).all(), f"max |resumed ps - one process| per rank: {rows.flatten().tolist()}"


@pytest.mark.parametrize("max_grad_norm", [None, 0.1])
def test_the_trainer_under_ps_matches_ddp(world, max_grad_norm):
    """The Trainer's loop (accumulation 2, warm-up, clipping) under ps and under ddp."""
    ddp = train(world, "ddp", max_steps=6, max_grad_norm=max_grad_norm)
    ps = train(world, "ps", max_steps=6, max_grad_norm=max_grad_norm)
    difference = (flat_parameters(ps.model) - flat_parameters(ddp.model)).abs().max()
    rows = collectives.allgather_rows(difference.reshape(1), name=f"ps.trainer.{max_grad_norm}")
    assert ps.global_step == ddp.global_step == 6
    assert (rows < 1e-10).all(), f"max |ps - ddp| per rank: {rows.flatten().tolist()}"


@pytest.mark.parametrize("fp16_allreduce", [False, True])
@pytest.mark.parametrize("servers", [1, 2])
def test_counted_bytes_per_step_equal_the_formula(world, servers, fp16_allreduce):
    """Padded Psi = K x slice. Worker: its K gradient slices out, the K weight slices in. Server:
    the other N - 1 workers' gradient slices in and its weights out to them (the seed's 2 x N x
    slice, less its own worker's, which stays on the rank), plus its worker's share with the other
    K - 1 servers. Gradients on the wire in fp16 under fp16_allreduce, weights in float64."""
    servers_or_skip(world, servers)
    data = synthetic_classification(samples=192)
    model = small_mlp(seed=0)
    strategy = build_strategy(ps_config(servers, fp16_allreduce=fp16_allreduce), model,
                              torch.optim.Adam(model.parameters(), lr=0.01), world)
    strategy.broadcast_from_root()
    ps_steps(strategy, data, global_batches(data, world.size, steps=2), world.rank)
    counted = strategy.traffic()
    rows = collectives.allgather_rows(torch.tensor([counted["sent"], counted["received"]]), name=f"ps.traffic.{servers}")

    n, k = world.size, servers
    psi = sum(p.numel() for p in small_mlp(seed=0).parameters())  # 276: one bucket, one group
    slice_numel = -(-psi // k)
    grad_bytes, weight_bytes = slice_numel * (2 if fp16_allreduce else 8), slice_numel * 8
    for rank in range(n):
        if rank < k:
            sent = (k - 1) * grad_bytes + (n - 1) * weight_bytes
            received = (n - 1) * grad_bytes + (k - 1) * weight_bytes
        else:
            sent, received = k * grad_bytes, k * weight_bytes
        assert rows[rank].tolist() == [sent, received], f"rank {rank} of {n}, {k} servers"
    if not fp16_allreduce and k == 1:  # the seed's figures, with the server one of the workers
        assert rows[0].sum() == 2 * (n - 1) * psi * 8
        assert all(int(row.sum()) == 2 * psi * 8 for row in rows[1:])


def test_a_server_holds_the_optimizer_state_of_its_slice_only(world):
    """Adam: exp_avg and exp_avg_sq of the server's slice (and its step count); a worker only a step count."""
    servers = min(2, world.size)
    data = synthetic_classification(samples=192)
    model = small_mlp(seed=0)
    strategy = build_strategy(ps_config(servers), model, torch.optim.Adam(model.parameters(), lr=0.01), world)
    strategy.broadcast_from_root()
    ps_steps(strategy, data, global_batches(data, world.size, steps=1), world.rank)
    held = strategy.memory_bytes()
    rows = collectives.allgather_rows(torch.tensor([held["optimizer_state"], held["parameters"]]), name="ps.memory")

    psi = sum(p.numel() for p in small_mlp(seed=0).parameters())
    slice_bytes = -(-psi // servers) * 8
    for rank, (state, parameters) in enumerate(rows.tolist()):
        assert parameters >= psi * 8  # every worker holds the whole model
        if rank < servers:
            assert 2 * slice_bytes <= state <= 2 * slice_bytes + 16, f"server {rank}: {state} bytes"
        else:  # Adam's step count of its empty slice, nothing per element
            assert state <= 8, f"worker {rank} holds {state} bytes of optimizer state"


def test_ps_refuses_more_servers_than_ranks_and_non_elementwise_optimizers(world):
    model = small_mlp(seed=0)
    with pytest.raises(ValueError, match="ps_servers must be a whole number from 1 to the world size"):
        build_strategy(ps_config(world.size + 1), model, torch.optim.SGD(model.parameters(), lr=0.1), world)
    with pytest.raises(ValueError, match="strategy=ps cannot serve LBFGS"):
        build_strategy(ps_config(1), model, torch.optim.LBFGS(model.parameters()), world)

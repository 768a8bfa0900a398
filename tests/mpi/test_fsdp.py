"""FSDP (ZeRO stage 3) is right when N workers take the same steps as one process with the whole
batch, hold the same full model and optimizer state, and each keep only their share of it, with a
unit's full parameters present only while it computes."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.distributed import collectives
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.strategies.fsdp.strategy import FSDPStrategy
from hvdtrain.strategies.zero import Zero2Strategy
from hvdtrain.strategies.sharding import storage
from tests.mpi.helpers import flat_parameters, synthetic_classification
from tests.mpi.test_zero import MICRO_BATCH, global_batch, reference_steps, state_difference, two_groups
from tests.mpi.test_zero import zero_steps as fsdp_steps  # the same hand-written loop

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank holds every unit whole: FSDP with a single shard and no padding"),
    pytest.mark.np4(reason="each rank's share of every unit and its padding change with the world size"),
    pytest.mark.gloo_np4(reason="the same shares at 4 ranks over Gloo's reduce-scatter and all-gather"),
]

FEATURES, CLASSES = 12, 5
STEPS = 3


class Block(nn.Module):
    """x + down(tanh(up(norm(x)))): 15 + 15 + 15 * 6 + 6 + 6 * 15 + 15 = 231 parameters, odd, so
    that every world size > 1 pads (weights 195, biases 36 in two parameter groups)."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class Blocks(nn.Module):
    """Three blocks (the default units) between a root part: embedding layer, final norm, head
    (195 + 30 + 80 = 305 parameters). ``skip``: a block that forward never uses."""

    def __init__(self, seed: int, width: int = 15, hidden: int = 6, dtype=torch.float64, skip=None):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Linear(FEATURES, width)
        self.blocks = nn.ModuleList(Block(width, hidden) for _ in range(3))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, CLASSES)
        self.skip = skip
        self.to(dtype)

    def forward(self, x):
        x = torch.tanh(self.embed(x))
        for index, block in enumerate(self.blocks):
            if index != self.skip:
                x = block(x)
        return self.head(self.norm(x))


OPTIMIZERS = {
    "sgd_momentum": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
    "two_groups": lambda model: torch.optim.AdamW(two_groups(model)),
}


def reference_from(initial_state, make_optimizer, make_model=lambda: Blocks(seed=0)):
    model = make_model()
    model.load_state_dict(initial_state)
    return model, make_optimizer(model)


def flat(state):
    return torch.cat([value.reshape(-1) for value in state.values()])


def model_difference(ours, theirs) -> float:
    if list(ours) != list(theirs):
        return float("inf")
    return max((ours[k] - theirs[k]).abs().max().item() for k in theirs)


def all_freed(strategy) -> bool:
    return not any(storage.is_allocated(bucket.flat_param) for bucket in strategy.buckets)


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("optimizer_name", sorted(OPTIMIZERS))
def test_n_workers_match_one_process_with_the_whole_batch(world, optimizer_name, accumulation):
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    make_optimizer = OPTIMIZERS[optimizer_name]
    model = Blocks(seed=100 + world.rank)  # different on every rank: set-up must fix that
    strategy = FSDPStrategy(model, make_optimizer(model), world, accumulation, False)
    strategy.broadcast_from_root()
    initial = strategy.state_dict()["model"]
    every_rank, idle, freed = [], [], []

    def record(step):
        idle.append(strategy.pending_communication() == [])
        freed.append(all_freed(strategy))
        every_rank.append(collectives.allgather_rows(flat(strategy.state_dict()["model"]), name=f"fsdp.test.{step}"))

    fsdp_steps(strategy, data, STEPS, accumulation, world, after_step=record)
    state = strategy.state_dict()
    reference, reference_optimizer = reference_from(initial, make_optimizer)
    reference_steps(reference, reference_optimizer, data, STEPS, rows=MICRO_BATCH * accumulation * world.size)
    local = torch.tensor([
        model_difference(state["model"], reference.state_dict()),
        (flat(state["model"]) - flat(initial)).abs().max().item(),
        state_difference(state["optimizer"], reference_optimizer.state_dict()),
    ], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.result")

    padding = sum(b.padded_numel for b in strategy.buckets) - sum(p.numel() for p in model.parameters())
    assert [unit.path for unit in strategy.units] == ["blocks.0", "blocks.1", "blocks.2"]
    root_modules = (model.embed, model.norm, model.head)
    assert {id(p) for b in strategy.root.buckets for p in b.params} == {id(p) for m in root_modules for p in m.parameters()}
    assert padding > 0 or world.size == 1
    assert all(idle), "collectives still pending after the step"
    assert all(freed), "a full parameter buffer is still allocated between steps"
    for step, rows in enumerate(every_rank):
        assert torch.equal(rows, rows[:1].expand_as(rows)), f"ranks' gathered parameters differ after step {step}"
    assert (everywhere[:, 1] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, 0] < 1e-10).all(), f"max |fsdp - one process| per rank: {everywhere[:, 0].tolist()}"
    assert (everywhere[:, 2] < 1e-10).all(), \
        f"max |optimizer state difference| (inf: not the same structure): {everywhere[:, 2].tolist()}"


def test_a_checkpoint_resumes_under_fsdp_zero_and_one_plain_optimizer(world):
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    make_optimizer, rows = OPTIMIZERS["two_groups"], MICRO_BATCH * world.size
    model = Blocks(seed=0)
    initial = copy.deepcopy(model.state_dict())
    original = FSDPStrategy(model, make_optimizer(model), world, 1, False)
    fsdp_steps(original, data, 2, 1, world)
    checkpoint = copy.deepcopy(original.state_dict())
    # The other way round: a checkpoint of one plain optimizer (as ddp writes it) resumed under fsdp.
    plain, plain_optimizer = reference_from(initial, make_optimizer)
    reference_steps(plain, plain_optimizer, data, 2, rows)
    plain_checkpoint = copy.deepcopy({"model": plain.state_dict(), "optimizer": plain_optimizer.state_dict()})

    resumed = []
    for state in (checkpoint, plain_checkpoint):
        fresh_model = Blocks(seed=7 + world.rank)
        fresh = FSDPStrategy(fresh_model, make_optimizer(fresh_model), world, 1, False)
        fresh.broadcast_from_root()  # the Trainer's order: broadcast, then load what it resumes
        fresh.load_state_dict(state)
        fresh.broadcast_from_root()  # again: the shards already form one model, nothing changes
        fsdp_steps(fresh, data, 2, 1, world, first=2)
        resumed.append(flat(fresh.state_dict()["model"]))
    zero_model = Blocks(seed=7)
    zero = Zero2Strategy(zero_model, make_optimizer(zero_model), world, 1, False)
    zero.load_state_dict(checkpoint)
    fsdp_steps(zero, data, 2, 1, world, first=2)
    fsdp_steps(original, data, 2, 1, world, first=2)
    continued = flat(original.state_dict()["model"])
    plain_optimizer.load_state_dict(checkpoint["optimizer"])  # fsdp's checkpoint, one plain process
    plain.load_state_dict(checkpoint["model"])
    reference_steps(plain, plain_optimizer, data, 2, rows, first=2)
    local = torch.tensor([(resumed[0] - continued).abs().max(), (resumed[1] - continued).abs().max(),
                          (flat_parameters(plain) - continued).abs().max(),
                          (flat_parameters(zero_model) - continued).abs().max()], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.resume")

    assert (everywhere[:, 0] == 0).all(), f"fsdp -> fsdp: {everywhere[:, 0].tolist()}"
    assert (everywhere[:, 1] < 1e-10).all(), f"plain -> fsdp: {everywhere[:, 1].tolist()}"
    assert (everywhere[:, 2] < 1e-10).all(), f"fsdp -> plain: {everywhere[:, 2].tolist()}"
    assert (everywhere[:, 3] < 1e-10).all(), f"fsdp -> zero2: {everywhere[:, 3].tolist()}"


def test_after_a_world_change_the_units_are_cut_anew_and_a_checkpoint_continues_them(world):
    """What Horovod elastic does to fsdp (re-formed at the same world here): follow_world cuts new
    buffers whose shards start at zero, the same optimizer object steps them with its state dropped,
    and the checkpoint loaded then continues exactly as before."""
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    model = Blocks(seed=0)
    strategy = FSDPStrategy(model, OPTIMIZERS["two_groups"](model), world, 1, False)
    strategy.broadcast_from_root()
    fsdp_steps(strategy, data, 2, 1, world)
    checkpoint = copy.deepcopy(strategy.state_dict())
    fsdp_steps(strategy, data, 2, 1, world, first=2)
    continued = flat(strategy.state_dict()["model"])

    optimizer, old_buckets = strategy.optimizer, strategy.buckets
    strategy.follow_world(world)
    relaid = [strategy.optimizer is optimizer, not optimizer.state,
              not {id(b) for b in strategy.buckets} & {id(b) for b in old_buckets},
              [[id(p) for p in g["params"]] for g in optimizer.param_groups]
              == [[id(b.shard) for b in strategy.buckets if b.group == g] for g in range(len(optimizer.param_groups))],
              all(not b.shard.any() for b in strategy.buckets)]
    strategy.load_state_dict(checkpoint)
    fsdp_steps(strategy, data, 2, 1, world, first=2)
    difference = (flat(strategy.state_dict()["model"]) - continued).abs().max().reshape(1).double()
    everywhere = collectives.allgather_rows(difference, name="fsdp.test.relaid")

    assert relaid == [True] * 5, "same optimizer, state dropped, new buffers, stepping them, shards at zero"
    assert (everywhere == 0).all(), f"max |continued after the re-cut - continued| per rank: {everywhere.tolist()}"


def test_broadcast_from_root_spreads_rank_0s_parameters_and_optimizer_state(world):
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    model = Blocks(seed=100 + world.rank)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    reference_steps(model, optimizer, data, 1, rows=8, first=world.rank)  # a different state on every rank
    root_state = collectives.broadcast_state(copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()}),
                                             root_rank=0, name="fsdp.test.root")
    strategy = FSDPStrategy(model, optimizer, world, 1, False)
    strategy.broadcast_from_root()
    state = strategy.state_dict()
    local = torch.tensor([model_difference(state["model"], root_state["model"]),
                          state_difference(state["optimizer"], root_state["optimizer"])], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.root.result")

    assert (everywhere == 0).all(), f"max |model, state - rank 0's| per rank: {everywhere.tolist()}"


def test_evaluation_gathers_each_unit_only_while_it_computes(world):
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    make_optimizer = OPTIMIZERS["sgd_momentum"]
    model = Blocks(seed=0)
    initial = copy.deepcopy(model.state_dict())
    strategy = FSDPStrategy(model, make_optimizer(model), world, 1, False)
    fsdp_steps(strategy, data, 2, 1, world)
    gathered_during = []
    for block in model.blocks:  # runs after the strategy's pre-hook (which goes first)
        block.register_forward_pre_hook(lambda module, args: gathered_during.append(
            [unit.path for unit in strategy.all_units if all(storage.is_allocated(b.flat_param) for b in unit.buckets)]))
    inputs = data.tensors[0][:10]
    with torch.no_grad():
        ours = model(inputs)
    freed, held, during = all_freed(strategy), strategy.memory_bytes()["parameters"], list(gathered_during)
    shards = sum(b.shard.numel() * b.shard.element_size() for b in strategy.buckets)
    strategy.unshard_model()  # then a plain model: its forward no longer gathers (no collective)
    alone = model(inputs)
    reference, reference_optimizer = reference_from(initial, make_optimizer)
    reference_steps(reference, reference_optimizer, data, 2, rows=MICRO_BATCH * world.size)
    local = torch.tensor([(ours - reference(inputs)).abs().max().item(),
                          (alone - ours).abs().max().item()], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.eval")

    # the block computing, the root, and the next block, prefetched: its gather writes into its
    # full buffer in place, so that buffer holds memory from the moment the gather starts
    assert during == [["", f"blocks.{i}"] + ([f"blocks.{i + 1}"] if i < 2 else []) for i in range(3)], \
        "units holding their full parameters while block 0, 1, 2 ran"
    assert freed and held == shards, f"a full buffer is left after evaluation: {held} bytes, shards {shards}"
    assert (everywhere[:, 0] < 1e-10).all(), f"max |fsdp output - one process| per rank: {everywhere.tolist()}"
    assert (everywhere[:, 1] == 0).all(), f"max |unsharded model's output - fsdp's| per rank: {everywhere.tolist()}"


@pytest.mark.parametrize("overlap", ["full", "gathers", "forward"])
def test_backward_starts_with_the_forwards_last_unit_still_gathered_and_the_next_on_its_way(world, overlap):
    """Once the first forward has shown the units' order: the last block is not freed after its
    forward (backward begins with it), so a step gathers it once, the others twice. Under full and
    gathers overlap the gather of the block before it starts while the root computes its backward,
    before the last block's gradients are reduce-scattered; under forward overlap only once those
    are (backward holds one block at a time). The step still ends with nothing full held."""
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    model = Blocks(seed=0)
    strategy = FSDPStrategy(model, OPTIMIZERS["adamw"](model), world, 1, False, overlap=overlap)
    events = []
    unit_of = {id(bucket): unit.path for unit in strategy.all_units for bucket in unit.buckets}
    start_gather, start_reduction = strategy.comm.start_gather, strategy.comm.start_reduction

    def gathering(unit):
        if unit.state == "free" and unit.path:  # a gather that really starts, of a block
            events.append(("gather", unit.path))
        start_gather(unit)

    def reducing(bucket):
        events.append(("reduce", unit_of[id(bucket)]))
        start_reduction(bucket)

    strategy.comm.start_gather, strategy.comm.start_reduction = gathering, reducing
    fsdp_steps(strategy, data, 1, 1, world)  # the first forward learns the order
    events.clear()
    fsdp_steps(strategy, data, 1, 1, world)
    gathers = [path for kind, path in events if kind == "gather"]
    freed = all_freed(strategy)

    assert gathers == ["blocks.0", "blocks.1", "blocks.2", "blocks.1", "blocks.0"], events
    ahead = events.index(("gather", "blocks.1"), 3) < events.index(("reduce", "blocks.2"))
    assert ahead == (overlap != "forward"), events
    assert freed, "a full parameter buffer is still allocated after the step"


def test_each_rank_holds_its_share_and_one_unit_at_a_time(world):
    torch.manual_seed(0)
    model = Blocks(seed=0, width=300, hidden=301, dtype=torch.float32)
    psi, n = sum(p.numel() for p in model.parameters()), world.size
    strategy = FSDPStrategy(model, torch.optim.Adam(model.parameters(), lr=1e-3), world, 1, False)
    strategy.broadcast_from_root()  # until then rank 0 keeps its initial parameters to spread them
    shards = sum(b.shard.numel() * 4 for b in strategy.buckets)
    seen = []  # parameter bytes held whenever a block starts its forward or its backward

    def note(*_):
        seen.append(strategy.memory_bytes()["parameters"])

    def note_in_backward(module, args, output):
        output.register_hook(note)

    for block in model.blocks:  # both run after the strategy's own hooks
        block.register_forward_pre_hook(note)
        block.register_forward_hook(note_in_backward)
    inputs, labels = torch.randn(4, FEATURES), torch.arange(4)
    strategy.backward(F.cross_entropy(model(inputs), labels))
    strategy.synchronize()
    strategy.step()
    strategy.zero_grad()
    held = strategy.memory_bytes()
    keys = ("parameters", "gradients", "optimizer_state")
    everywhere = collectives.allgather_rows(torch.tensor([held[k] for k in keys] + [max(seen)], dtype=torch.float64),
                                            name="fsdp.test.memory")

    # ZeRO-3's figures in fp32 with Adam: parameters 4 Psi / N, gradients 4 Psi / N, exp_avg and
    # exp_avg_sq 8 Psi / N: 16 Psi / N in all. The root unit (1% of Psi here) is freed after
    # backward like every other unit, so between steps nothing full is held; the rest is padding
    # (under N elements per buffer) and Adam's scalar step per shard: far below the 10% allowed.
    expected = torch.tensor([4 * psi / n, 4 * psi / n, 8 * psi / n], dtype=torch.float64)
    ratio = everywhere[:, :3] / expected
    largest, root = strategy.largest_unit_bytes(), strategy.root.full_bytes
    assert largest == max(unit.full_bytes for unit in strategy.units) > root
    assert all_freed(strategy), "a full parameter buffer is still allocated between steps"
    assert ((ratio - 1).abs() < 0.1).all(), f"held / expected per rank ({', '.join(keys)}): {ratio.tolist()}"
    # While a block computes: the shards, the root, that block, and at most one other (the one
    # prefetched, whose gather writes into its full buffer from its start, or a block whose
    # gradients are not all in yet).
    assert len(seen) == 6 and (everywhere[:, 3] <= shards + root + 2 * largest).all(), \
        f"parameter bytes held during the step: {everywhere[:, 3].tolist()}, bound {shards + root + 2 * largest}"


@pytest.mark.parametrize("overlap", ["full", "gathers", "forward", "none"])
def test_each_overlap_holds_what_it_promises_during_a_step_and_takes_one_process_steps(world, overlap):
    """train.fsdp_overlap's bound on what a rank holds during a step, counted after each gather and
    before each reduce-scatter (where the most is held), in the second step (the first learns the
    units' order): besides its shards (what it holds between steps) and the root's parameters and
    full gradient (whole from forward to the end of backward), forward and none hold two blocks'
    full size (the one whose gradients are complete, and those gradients: nothing runs ahead in
    backward); gathers three (the block before it, prefetched); full at least three and at most
    four (the block after it, still being reduce-scattered). At most one reduce-scatter runs behind
    backward under full, none otherwise. Every mode takes one process's steps."""
    model = Blocks(seed=0, width=300, hidden=301, dtype=torch.float32)
    strategy = FSDPStrategy(model, torch.optim.Adam(model.parameters(), lr=1e-3), world, 1, False, overlap=overlap)
    strategy.broadcast_from_root()
    held, in_flight = [], []
    gather, reduce = strategy.comm.ensure_gathered, strategy.comm.start_reduction

    def gathered(unit):
        gather(unit)
        held.append(sum(strategy.memory_bytes().values()))

    def reducing(bucket):
        held.append(sum(strategy.memory_bytes().values()))
        reduce(bucket)
        in_flight.append(sum(name.startswith("fsdp.grad") for name in strategy.comm.in_flight))

    strategy.comm.ensure_gathered, strategy.comm.start_reduction = gathered, reducing
    torch.manual_seed(1)
    inputs, labels = torch.randn(4, FEATURES), torch.arange(4)
    for _ in range(2):
        held.clear()
        strategy.backward(F.cross_entropy(model(inputs), labels))
        strategy.step()
        strategy.zero_grad()
    between = sum(strategy.memory_bytes().values())
    block, root = strategy.largest_unit_bytes(), strategy.root.full_bytes
    everywhere = collectives.allgather_rows(torch.tensor([max(held), max(in_flight)], dtype=torch.float64),
                                            name=f"fsdp.test.overlap.{overlap}")

    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    make_optimizer = OPTIMIZERS["adamw"]
    model = Blocks(seed=0)
    initial = copy.deepcopy(model.state_dict())
    strategy = FSDPStrategy(model, make_optimizer(model), world, 1, False, overlap=overlap)
    fsdp_steps(strategy, data, 2, 1, world)
    state = strategy.state_dict()["model"]
    reference, reference_optimizer = reference_from(initial, make_optimizer)
    reference_steps(reference, reference_optimizer, data, 2, rows=MICRO_BATCH * world.size)
    difference = collectives.allgather_rows(torch.tensor([model_difference(state, reference.state_dict())],
                                                         dtype=torch.float64), name=f"fsdp.test.overlap.{overlap}.steps")

    extra = everywhere[:, 0] - between - 2 * root
    assert block > root and strategy.overlap == overlap
    if overlap == "full":
        assert ((extra >= 3 * block) & (extra <= 4 * block)).all(), f"held beyond shards and root, in blocks: {(extra / block).tolist()}"
        assert (everywhere[:, 1] <= 1).all(), f"reduce-scatters in flight after one started: {everywhere[:, 1].tolist()}"
    else:
        blocks = 3 if overlap == "gathers" else 2
        assert (extra == blocks * block).all(), f"held beyond shards and root, in blocks: {(extra / block).tolist()}"
        assert (everywhere[:, 1] == 0).all(), f"reduce-scatters in flight after one started: {everywhere[:, 1].tolist()}"
    assert (difference < 1e-10).all(), f"max |fsdp - one process| per rank: {difference.tolist()}"


@pytest.mark.parametrize("make_strategy", [FSDPStrategy, Zero2Strategy], ids=["fsdp", "zero2"])
def test_gradients_cleared_by_the_strategy_or_by_the_shard_optimizer_start_the_next_step_from_zero(world, make_strategy):
    """zero_grad() leaves the shards' .grad None and the next reduce-scatter's output becomes the
    shard gradient (no pass over memory); the shard optimizer's own zero_grad() (torch sets .grad to
    None) is honoured alike, not added to; a synchronize with no backward since reads zeros."""
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    make_optimizer = OPTIMIZERS["adamw"]
    model = Blocks(seed=0)
    initial = copy.deepcopy(model.state_dict())
    strategy = make_strategy(model, make_optimizer(model), world, 2, False)
    rows = MICRO_BATCH * 2 * world.size
    cleared = []
    for step in range(STEPS):
        inputs, labels = global_batch(data, step, rows)
        mine = inputs[world.rank::world.size], labels[world.rank::world.size]
        for x, y in zip(mine[0].chunk(2), mine[1].chunk(2)):
            strategy.backward(F.cross_entropy(strategy.model(x), y) / 2)
        strategy.synchronize()
        strategy.step()
        if step % 2 == 0:
            strategy.zero_grad()
        else:
            strategy.optimizer.zero_grad()  # the shard optimizer's: torch sets every .grad to None
        cleared.append(all(bucket.shard.grad is None for bucket in strategy.buckets))
    strategy.synchronize()  # no backward since the gradients were cleared
    settled = [bucket.shard.grad is not None and not bucket.shard.grad.any() for bucket in strategy.buckets]
    state = strategy.state_dict()["model"]
    reference, reference_optimizer = reference_from(initial, make_optimizer)
    reference_steps(reference, reference_optimizer, data, STEPS, rows=rows)
    local = torch.tensor([model_difference(state, reference.state_dict())], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.cleared")

    assert all(cleared), f"a shard's .grad survived zero_grad (per step: {cleared})"
    assert all(settled), "a synchronize with no backward left a shard gradient None or not zero"
    assert (everywhere < 1e-10).all(), f"max |strategy - one process| per rank: {everywhere.tolist()}"


def test_an_unused_unit_does_not_hang_the_step(world):
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    make_optimizer = OPTIMIZERS["sgd_momentum"]
    model = Blocks(seed=0, skip=1)
    initial = copy.deepcopy(model.state_dict())
    strategy = FSDPStrategy(model, make_optimizer(model), world, 2, False)
    fsdp_steps(strategy, data, 2, 2, world)
    state = strategy.state_dict()["model"]
    reference, reference_optimizer = reference_from(initial, make_optimizer, lambda: Blocks(seed=1, skip=1))
    reference_steps(reference, reference_optimizer, data, 2, rows=MICRO_BATCH * 2 * world.size)
    unused = "blocks.1.up.weight"
    local = torch.tensor([model_difference(state, reference.state_dict()),
                          (state[unused] - initial[unused]).abs().max()], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.unused")

    assert (everywhere[:, 1] == 0).all(), f"the unused block moved (weight decay, momentum): {everywhere[:, 1].tolist()}"
    assert (everywhere[:, 0] < 1e-10).all(), f"max |fsdp - one process| per rank: {everywhere[:, 0].tolist()}"


def test_a_custom_wrap_policy_with_nothing_ahead_matches_one_process(world):
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    make_optimizer = OPTIMIZERS["adamw"]
    model = Blocks(seed=0)
    initial = copy.deepcopy(model.state_dict())
    strategy = FSDPStrategy(model, make_optimizer(model), world, 1, False,
                            wrap_policy=lambda module: isinstance(module, nn.Linear), overlap="none")
    fsdp_steps(strategy, data, 2, 1, world)
    state = strategy.state_dict()["model"]
    reference, reference_optimizer = reference_from(initial, make_optimizer)
    reference_steps(reference, reference_optimizer, data, 2, rows=MICRO_BATCH * world.size)
    local = torch.tensor([model_difference(state, reference.state_dict())], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.policy")

    linears = ["embed"] + [f"blocks.{i}.{name}" for i in range(3) for name in ("up", "down")] + ["head"]
    assert [unit.path for unit in strategy.units] == linears
    assert (everywhere < 1e-10).all(), f"max |fsdp - one process| per rank: {everywhere.tolist()}"


def test_a_tiny_transformer_with_tied_weights_matches_one_process(world):
    """textlm's model: the blocks are the units; embeddings, final norm and the head tied to the
    token embedding are the root."""
    generator = torch.Generator().manual_seed(5)
    windows = torch.randint(0, 11, (96, 9), generator=generator)
    make_model = lambda: TinyTransformerLM(vocab_size=11, seq_len=8, d_model=6, layers=3, heads=2).double()
    make_optimizer = OPTIMIZERS["adamw"]
    torch.manual_seed(0)
    model = make_model()
    initial = copy.deepcopy(model.state_dict())
    strategy = FSDPStrategy(model, make_optimizer(model), world, 2, False)
    steps, rows = 2, 2 * 2 * world.size
    for step in range(steps):
        mine = windows[step * rows:(step + 1) * rows][world.rank::world.size]
        for micro in mine.chunk(2):
            strategy.backward(lm_loss(model(micro[:, :-1]), micro[:, 1:]) / 2)
        strategy.synchronize()
        strategy.step()
        strategy.zero_grad()
    state = strategy.state_dict()
    reference = make_model()
    reference.load_state_dict(initial)
    reference_optimizer = make_optimizer(reference)
    for step in range(steps):
        batch = windows[step * rows:(step + 1) * rows]
        reference_optimizer.zero_grad()
        lm_loss(reference(batch[:, :-1]), batch[:, 1:]).backward()
        reference_optimizer.step()
    local = torch.tensor([model_difference(state["model"], reference.state_dict()),
                          state_difference(state["optimizer"], reference_optimizer.state_dict()),
                          (flat(state["model"]) - flat(initial)).abs().max().item()], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.lm")

    assert [unit.path for unit in strategy.units] == ["blocks.0", "blocks.1", "blocks.2"]
    assert {id(p) for b in strategy.root.buckets for p in b.params} == \
        {id(model.token.weight), id(model.position.weight), id(model.norm.weight), id(model.norm.bias)}
    assert (everywhere[:, 2] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, :2] < 1e-10).all(), f"max |model|, |optimizer state| differences: {everywhere.tolist()}"


def test_fp16_reduction_stays_close_to_full_precision(world):
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES, dtype=torch.float32)
    make_optimizer = OPTIMIZERS["sgd_momentum"]
    make_model = lambda: Blocks(seed=0, dtype=torch.float32)
    model = make_model()
    initial = copy.deepcopy(model.state_dict())
    strategy = FSDPStrategy(model, make_optimizer(model), world, 1, True)
    fsdp_steps(strategy, data, 2, 1, world)
    state = strategy.state_dict()["model"]
    reference, reference_optimizer = reference_from(initial, make_optimizer, make_model)
    reference_steps(reference, reference_optimizer, data, 2, rows=MICRO_BATCH * world.size)
    local = torch.tensor([model_difference(state, reference.state_dict()),
                          (flat(state) - flat(initial)).abs().max().item()], dtype=torch.float64)
    everywhere = collectives.allgather_rows(local, name="fsdp.test.fp16")

    assert all(b.grad_name.endswith(".fp16") for b in strategy.buckets)
    assert (everywhere[:, 1] > 1e-3).all(), "training did not move the parameters: the test proves nothing"
    assert (everywhere[:, 0] < 1e-3).all(), f"max |fp16 fsdp - fp32 one process| per rank: {everywhere[:, 0].tolist()}"


def test_an_optimizer_that_looks_at_whole_tensors_is_refused(world):
    model = Blocks(seed=0)
    with pytest.raises(ValueError, match=r"LBFGS.*look at whole tensors.*--train\.strategy=ddp"):
        FSDPStrategy(model, torch.optim.LBFGS(model.parameters()), world, 1, False)

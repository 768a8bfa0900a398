"""Expert parallelism under ZeRO (train.strategy=zero1 or zero2, train.expert_parallel=E): the fused
experts split over E ranks and kept out of ZeRO's flat buckets, the rest sharded by zero1/zero2 over
every rank. Qwen3-MoE (one dense layer), Mixtral (the load-balancing loss in the loss), Qwen2-MoE (a
shared expert and its gate, whole) and hvdtrain's own example, the toy shapes of test_hf_moe.py; E=2 at
2 ranks (every rank holds other experts: no replica group), E=2 x 2 replica groups and E=4 at 4 ranks.

The reference is test_hf_moe.py's one process, each step one micro-batch per data rank (every rank is
one), gradients averaged. Float64 with transformers' eager experts, 3 steps of AdamW (and of SGD),
bound 1e-10: the layouts differ from one process only in the order of float64 additions (ZeRO's
reduce-scatter of the rest, the experts' tokens summed on their owner, the replica average), while an
expert averaged with another rank's experts, an expert gradient reduce-scattered by ZeRO over every
rank (not divided by E), a token sent to the wrong owner or a lost step of the expert shares moves the
weights by more than 1e-4 (checked: how far training moved every weight). Adam all but ignores a
constant factor on a gradient, so SGD (its step is the gradient) is run too: an expert gradient not
divided by E moved Qwen2-MoE's weights by 1.3e-3 there (checked by breaking the reduction). Clipping
that counts the experts on every rank differs only once ranks outside the first expert group exist
(4 ranks at E=2: 7e-7 off, checked likewise); accumulation=2 checks the experts' gradients added up
over micro-batches while zero2 reduce-scatters the rest every micro-batch.

Checkpoints as tests/mpi/test_expert_checkpoint.py proves fsdp x E's: full (resumed under zero1, zero2,
fsdp x E and ddp at E=1, loaded whole, exported, read as pretrained weights) and sharded (each rank its
slices of the buckets, the experts once; continued bitwise; resharded to E=1, other strategies x E and
E=4), and fsdp x E's and ddp x E's sharded checkpoints resumed under zero1 x E.
"""
import contextlib
import copy
from pathlib import Path

import pytest
import torch

from hvdtrain.distributed import collectives
from hvdtrain.verify.exact import float64_throughout
from tests.mpi.test_hf_experts import exported_differences, pretrained_differences
from tests.mpi.test_hf_moe import EXAMPLE, differences_from_one_process, expert_names, train

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets,
              pytest.mark.np4(reason="E=4, and E=2 x two replica groups of each expert, fit only at 4 ranks")]

ZERO = ["zero1", "zero2"]


def fits(world, experts):
    if world.size % experts:
        pytest.skip(f"expert_parallel={experts} needs a world that divides by it")


def layout_of(trainer, experts):
    """(label, held shapes of the split parameters, the split ones found in ZeRO's buckets)."""
    strategy = trainer.strategy
    held = {name: tuple(p.shape) for name, p in trainer.model.named_parameters() if hasattr(p, "expert_shard")}
    in_buckets = {id(p) for bucket in strategy.buckets for p in bucket.params}
    experts_in_buckets = [name for name, p in trainer.model.named_parameters() if id(p) in in_buckets and name in held]
    return strategy.label, held, experts_in_buckets


@pytest.mark.timeout(300)
@pytest.mark.parametrize("experts", [2, 4])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", EXAMPLE])
@pytest.mark.parametrize("strategy", ZERO)
def test_zero_with_split_experts_takes_one_process_adamw_steps(world, strategy, family, experts):
    fits(world, experts)
    if world.size > 2 and family not in {2: ("mixtral", "qwen2_moe"), 4: ("qwen3_moe",)}[experts]:
        pytest.skip("past 2 ranks two families at E=2 (two replica groups), one at E=4: what the families "
                    "differ in, 2 ranks check")
    with float64_throughout():
        trainer, data, initial, final, step_losses = train(world, family, strategy=strategy, expert_parallel=experts)
        label, held, experts_in_buckets = layout_of(trainer, experts)
        trainer.close_mesh()
        worst, loss_error, moved, experts_moved = differences_from_one_process(family, data, initial, final,
                                                                              step_losses, world.size)
    print(f"\n{family} {strategy} x E={experts} AdamW at {world.size} ranks: max |param - one process| {worst:.2e}, "
          f"max |loss - one process| {loss_error:.2e}, experts moved >= {experts_moved:.2e}")

    assert label == f"{strategy} x experts {experts}"
    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {loss_error}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"
    # Every expert parameter split (1/E of the experts), gathered whole; none of them in ZeRO's buckets;
    # routers, the shared expert and its gate whole.
    assert expert_names(final) and sorted(held) == expert_names(final) and experts_in_buckets == []
    for name, shape in held.items():
        assert shape[0] * experts == final[name].shape[0] and shape[1:] == tuple(final[name].shape[1:])
    assert not any(".mlp.gate." in name or "shared_expert" in name for name in held)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("experts", [2, 4])
@pytest.mark.parametrize("strategy", ZERO)
def test_zero_with_split_experts_takes_one_process_sgd_steps(world, strategy, experts):
    """SGD, whose step is the gradient itself: an expert gradient off by a factor (not divided by E,
    averaged with the wrong ranks) moves the weights by that factor of a step."""
    fits(world, experts)
    family = "qwen2_moe"
    with float64_throughout():
        trainer, data, initial, final, step_losses = train(world, family, torch.optim.SGD, 1.0, strategy=strategy,
                                                           expert_parallel=experts)
        label, held, experts_in_buckets = layout_of(trainer, experts)
        trainer.close_mesh()
        worst, loss_error, moved, experts_moved = differences_from_one_process(
            family, data, initial, final, step_losses, world.size, optimizer_class=torch.optim.SGD, lr=1.0)
    print(f"\n{family} {strategy} x E={experts} SGD at {world.size} ranks: max |param - one process| {worst:.2e}, "
          f"max |loss - one process| {loss_error:.2e}, experts moved >= {experts_moved:.2e}")

    assert label == f"{strategy} x experts {experts}" and held and experts_in_buckets == []
    assert experts_moved > 1e-4, "training did not move every expert: the test proves nothing"
    assert loss_error < 1e-10 and worst < 1e-10, (worst, loss_error)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ZERO)
def test_accumulated_micro_batches_take_one_process_steps(world, strategy):
    """accumulation=2: zero2 reduce-scatters the rest every micro-batch, zero1 once per step, and the
    experts' gradients add up in their .grad over the step's micro-batches and are averaged over their
    replica group once; Mixtral (its load-balancing loss per micro-batch), 2 AdamW steps against one
    process taking every rank's micro-batches, each loss divided by N x 2."""
    from tests.mpi.test_hf_moe import BATCH, SEED, make_model, make_trainer, moe_step, token_data
    from hvdtrain.data.sharding import ShardedSampler

    fits(world, 2)
    accumulation, steps, family = 2, 2, "mixtral"
    with float64_throughout():
        data = token_data(128)
        trainer = make_trainer(world, make_model(family, 100 + world.rank), data, max_steps=steps, strategy=strategy,
                               expert_parallel=2, accumulation=accumulation)
        initial = copy.deepcopy(trainer.strategy.state_dict()["model"])  # not the live tensors
        trainer.fit()
        final = trainer.strategy.state_dict()["model"]
        label = trainer.strategy.label
        trainer.close_mesh()
        model = make_model(family, 0)
        model.load_state_dict(initial)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
        per_step = BATCH * accumulation
        orders = []
        for rank in range(world.size):
            sampler = ShardedSampler(len(data), rank=rank, world_size=world.size, seed=SEED,
                                     global_batch=per_step * world.size)
            sampler.set_epoch(0)
            orders.append(list(sampler))
        for step in range(steps):
            optimizer.zero_grad()
            for order in orders:
                for micro in range(accumulation):
                    start = step * per_step + micro * BATCH
                    batch = order[start:start + BATCH]
                    loss, _ = moe_step(model, (data.tensors[0][batch], data.tensors[1][batch]))
                    (loss / (len(orders) * accumulation)).backward()
            optimizer.step()
    worst = max((final[name] - t).abs().max().item() for name, t in model.state_dict().items())
    moved = min((t - initial[name]).abs().max().item() for name, t in model.state_dict().items())
    print(f"\n{family} {strategy} x E=2 accumulation {accumulation}: max |param - one process| {worst:.2e}, "
          f"every weight moved >= {moved:.2e}")

    assert label == f"{strategy} x experts 2"
    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert worst < 1e-10, worst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ZERO)
def test_each_rank_holds_one_eth_of_the_experts_and_one_nth_of_the_rest_s_state(world, strategy):
    """Bytes on each rank at E=2 after a backward and the reduction: expert parameters, gradients and
    AdamW state half of the whole experts'; the rest's AdamW state ZeRO's slices, 1/N of it (plus each
    bucket's padding to a multiple of N), its gradients 1/N under zero2 and whole under zero1, its
    parameters whole; the strategy's own count is their sum."""
    from tests.mpi.test_hf_moe import moe_step, token_data

    fits(world, 2)
    trainer, _, _, final, _ = train(world, "mixtral", max_steps=1, strategy=strategy, expert_parallel=2)
    strategy_ = trainer.strategy
    data = token_data()
    strategy_.forward_backward(moe_step, (data.tensors[0][:4], data.tensors[1][:4]), contextlib.nullcontext,
                               lambda loss: loss, 1)
    strategy_.synchronize()
    split = [p for p in trainer.model.parameters() if hasattr(p, "expert_shard")]
    shards = [bucket.shard for bucket in strategy_.buckets]
    size = 8  # float64
    whole = sum(final[name].numel() for name in expert_names(final)) * size
    rest = sum(t.numel() for name, t in final.items() if name not in expert_names(final))
    padded = sum(bucket.padded_numel for bucket in strategy_.buckets)

    def state_bytes(params):
        return sum(v.numel() * v.element_size() for p in params for v in strategy_.optimizer.state[p].values()
                   if isinstance(v, torch.Tensor) and v.dim())

    held = {"parameters": sum(p.numel() * p.element_size() for p in split),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in split if p.grad is not None),
            "optimizer_state": state_bytes(split)}
    sharded = {"shard": sum(s.numel() * s.element_size() for s in shards),
               "optimizer_state": state_bytes(shards)}
    reported = strategy_.memory_bytes()
    steps = sum(v.untyped_storage().nbytes() for state in strategy_.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and not v.dim())  # AdamW's step counts
    strategy_.zero_grad()
    trainer.close_mesh()
    seen = collectives.allgather_object((held, sharded), name="ep.zero.bytes")

    assert all(counts == seen[0] for counts in seen)
    assert 0 <= padded - rest < world.size * len(strategy_.buckets)
    assert held == {"parameters": whole // 2, "gradients": whole // 2, "optimizer_state": 2 * (whole // 2)}
    own = padded // world.size * size
    assert sharded == {"shard": own, "optimizer_state": 2 * own}
    rest_gradients = own if strategy == "zero2" else padded * size  # zero1 keeps the full buffers
    assert reported == {"parameters": whole // 2 + padded * size, "gradients": whole // 2 + rest_gradients,
                        "optimizer_state": 2 * (whole // 2 + own) + steps}


@pytest.mark.timeout(400)
def test_a_full_checkpoint_holds_the_experts_whole_and_resumes_under_any_layout(world, shared_tmp_path):
    """Qwen2-MoE at zero1 x E=2 writes a full checkpoint (every expert once, gathered whole, and its AdamW
    moments, under one process's names and indices), which resumes bitwise under zero1 x E=2, zero2 x
    E=2, fsdp x E=2, and ddp at E=1; the gathered state loads into a fresh zero2 x E=2 model bitwise, and
    the exported directory loads in plain transformers and as pretrained weights at zero2 x E=2 to the
    same tensors."""
    from tests.mpi.test_hf_moe import make_model, make_trainer, token_data
    from tests.mpi.test_mesh_checkpoint import differences

    fits(world, 2)
    directory, data, steps = shared_tmp_path / "ckpt", token_data(), 2

    def trainer_in(path, seed, **layout):
        return make_trainer(world, make_model("qwen2_moe", seed), data, max_steps=steps, checkpoint_dir=str(path),
                            **layout)

    written = trainer_in(directory, 100 + world.rank, strategy="zero1", expert_parallel=2)
    written.fit()
    saved = written.strategy.state_dict()
    written.export_hf(Path(directory) / "hf")
    resumed = {}
    for name, layout in (("zero1 E2", {"strategy": "zero1", "expert_parallel": 2}),
                         ("zero2 E2", {"strategy": "zero2", "expert_parallel": 2}),
                         ("fsdp E2", {"strategy": "fsdp", "expert_parallel": 2}), ("ddp E1", {})):
        trainer = trainer_in(directory, 200, **layout)  # resumes step 2 of 2: nothing left to train
        trainer.fit()
        resumed[name] = differences(trainer.strategy.state_dict(), saved)
        trainer.close_mesh()
    fresh = make_trainer(world, make_model("qwen2_moe", 300), data, strategy="zero2", expert_parallel=2)
    fresh.strategy.load_state_dict(saved)
    resumed["loaded whole"] = differences(fresh.strategy.state_dict(), saved)
    fresh.close_mesh()
    pretrained = make_trainer(world, make_model("qwen2_moe", 400), data, strategy="zero2", expert_parallel=2)
    # weights only: each rank takes its experts, ZeRO its buckets
    resumed["pretrained"] = pretrained_differences(pretrained, Path(directory) / "hf", saved)
    pretrained.close_mesh()
    written.close_mesh()
    exported = exported_differences(world, Path(directory) / "hf", saved, name="ep.zero.exported")

    name = "model.layers.0.mlp.experts.gate_up_proj"
    index = [n for n, _ in make_model("qwen2_moe", 0).named_parameters()].index(name)  # the optimizer's numbering
    assert tuple(saved["model"][name].shape) == (4, 2 * 16, 32), "gathered whole: every expert"
    assert saved["optimizer"]["state"][index]["exp_avg"].shape == saved["model"][name].shape, \
        "the experts' AdamW moments gathered whole, at one process's index"
    assert resumed == {"zero1 E2": [], "zero2 E2": [], "fsdp E2": [], "ddp E1": [], "loaded whole": [],
                       "pretrained": []}
    assert exported == []


ZERO_EXPERTS = {"strategy": "zero2", "expert_parallel": 2, "checkpoint_format": "sharded"}


def zero_layouts(world):
    """The layouts a zero2 x E=2 sharded checkpoint is resumed under: E=1 (ddp, full; zero1, sharded),
    zero1 x E=2, ddp x E=2, fsdp x E=2 and, where it fits, zero2 x E=4."""
    found = {"E1": {"checkpoint_format": "full"}, "E1-zero1": {"strategy": "zero1", "checkpoint_format": "sharded"},
             "E2-zero1": {**ZERO_EXPERTS, "strategy": "zero1"},
             "E2-ddp": {"expert_parallel": 2, "checkpoint_format": "sharded"},
             "E2-fsdp": {**ZERO_EXPERTS, "strategy": "fsdp"}}
    if world.size % 4 == 0:
        found["E4-zero2"] = {**ZERO_EXPERTS, "expert_parallel": 4}
    return found


@pytest.mark.timeout(900)
def test_zero_with_experts_writes_its_own_slices_and_each_expert_once_and_reshards(world, shared_tmp_path):
    """A sharded checkpoint at zero2 x E=2: each rank writes its slices of the buckets, the first expert
    group each expert once; a run continuing it at its own layout stays bitwise on an uninterrupted
    one; it is resumed at every layout of zero_layouts to exactly the state written; it consolidates and
    exports to what transformers loads (test_expert_checkpoint.py's checks)."""
    from tests.mpi.test_expert_checkpoint import save_continue_and_resume

    fits(world, 2)
    saved, seen, continued_off, resumed = save_continue_and_resume(world, shared_tmp_path, ZERO_EXPERTS,
                                                                   zero_layouts(world))

    assert "error" not in seen, seen["error"]
    whole = {name: saved["model"][name].numel() for name in expert_names(saved["model"])}
    assert whole and seen["on_disk"] == whole, "every expert once: the whole experts' elements, no more"
    assert all(ranks == [0, 1] for ranks in seen["holders"].values()), seen["holders"]  # the first expert group
    assert seen["rest_held_otherwise"] == [], "every other tensor's elements once over the files"
    assert seen["rest_writers"] == list(range(world.size)), "each rank writes its own slices: nothing gathered"
    assert seen["codes"] == [0, 0] and seen["files"] == world.size
    assert continued_off == [], "the continued run left the uninterrupted one"
    assert set(resumed) == set(zero_layouts(world)) and all(wrong == [] for wrong in resumed.values()), resumed
    assert seen["consolidated"] == [] and seen["exported"] == [] and seen["logits_equal"]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("writer", ["fsdp", "ddp"])
def test_an_fsdp_or_ddp_with_experts_sharded_checkpoint_resumes_under_zero1_with_experts_exactly(world,
                                                                                                shared_tmp_path,
                                                                                                writer):
    from tests.mpi.test_expert_checkpoint import STEPS, gathered, resumed_from, trainer_in
    from tests.mpi.test_mesh_checkpoint import differences

    fits(world, 2)
    directory = shared_tmp_path / "ckpt"
    written = trainer_in(world, directory, STEPS, 100 + world.rank, strategy=writer, expert_parallel=2,
                         checkpoint_format="sharded")
    written.fit()
    saved = gathered(written)
    resumed = resumed_from(world, directory / f"ckpt-{STEPS:09d}", shared_tmp_path / "resume",
                           **{**ZERO_EXPERTS, "strategy": "zero1"})

    assert differences(resumed, saved) == []

"""Expert parallelism under fsdp (train.strategy=fsdp, train.expert_parallel=E): the fused experts split
over E ranks and kept out of fsdp's units, the rest sharded by fsdp over every rank. Qwen3-MoE (one
dense layer) and Mixtral (the load-balancing loss in the loss), the toy shapes of test_hf_moe.py; E=2
at 2 ranks (every rank holds other experts: no replica group), and E=2 x fsdp D=2 at 4 ranks (two
replica groups: the experts' gradients averaged over them).

The reference is test_hf_moe.py's one process, each step one micro-batch per data rank (every rank is
one), gradients averaged. Float64 with transformers' eager experts, 3 AdamW steps, bound 1e-10: the
layouts differ from one process only in the order of float64 additions (fsdp's reduce-scatter of the
rest, the experts' tokens summed on their owner, the replica average), a few hundred roundings of
1e-16 per step, while an expert averaged with another rank's experts, an expert gradient reduced by
fsdp over every rank (not divided by E), a token sent to the wrong owner or a lost step of the expert
shares moves the weights by more than 1e-4 (checked: how far training moved every expert).
"""
import contextlib

import pytest
import torch

from hvdtrain.distributed import collectives
from hvdtrain.verify.exact import float64_throughout
from tests.mpi.test_hf_experts import exported_differences, pretrained_differences
from tests.mpi.test_hf_moe import EXAMPLE, differences_from_one_process, expert_names, train

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets,
              pytest.mark.np4(reason="E=2 x fsdp D=2: two replica groups of each expert fit only at 4 ranks")]


def even_world(world):
    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", EXAMPLE])
def test_fsdp_with_split_experts_takes_one_process_steps(world, family):
    even_world(world)
    with float64_throughout():
        trainer, data, initial, final, step_losses = train(world, family, strategy="fsdp", expert_parallel=2)
        strategy = trainer.strategy
        held = {name: tuple(p.shape) for name, p in trainer.model.named_parameters() if hasattr(p, "expert_shard")}
        in_units = {id(p) for bucket in strategy.buckets for p in bucket.params}
        experts_in_units = [name for name, p in trainer.model.named_parameters() if id(p) in in_units
                            and name in held]
        label = strategy.label
        trainer.close_mesh()
        worst, loss_error, moved, experts_moved = differences_from_one_process(family, data, initial, final,
                                                                              step_losses, world.size)
    print(f"\n{family} fsdp x E=2 at {world.size} ranks: max |param - one process| {worst:.2e}, "
          f"max |loss - one process| {loss_error:.2e}, experts moved >= {experts_moved:.2e}")

    assert label == "fsdp x experts 2"
    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {loss_error}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"
    # Every expert parameter split (half the experts), gathered whole; none of them in fsdp's units.
    assert expert_names(final) and sorted(held) == expert_names(final) and experts_in_units == []
    for name, shape in held.items():
        assert shape[0] * 2 == final[name].shape[0] and shape[1:] == tuple(final[name].shape[1:])


@pytest.mark.timeout(240)
def test_each_rank_holds_one_eth_of_the_experts_and_one_nth_of_the_rest(world):
    """Bytes on each rank at E=2 after a backward and the reduction: expert parameters, gradients and
    AdamW state half of the whole experts'; the rest fsdp's shards, 1/N of it (plus each unit's padding
    to a multiple of N); the strategy's own count is their sum (fsdp's full buffers freed)."""
    from tests.mpi.test_hf_moe import moe_step, token_data

    even_world(world)
    trainer, _, _, final, _ = train(world, "mixtral", max_steps=1, strategy="fsdp", expert_parallel=2)
    strategy = trainer.strategy
    data = token_data()
    strategy.forward_backward(moe_step, (data.tensors[0][:4], data.tensors[1][:4]), contextlib.nullcontext,
                              lambda loss: loss, 1)
    strategy.synchronize()
    split = [p for p in trainer.model.parameters() if hasattr(p, "expert_shard")]
    shards = [bucket.shard for bucket in strategy.buckets]
    size = 8  # float64
    whole = sum(final[name].numel() for name in expert_names(final)) * size
    rest = sum(t.numel() for name, t in final.items() if name not in expert_names(final))
    padding = sum(bucket.padded_numel for bucket in strategy.buckets) - rest

    def state_bytes(params):
        return sum(v.numel() * v.element_size() for p in params for v in strategy.optimizer.state[p].values()
                   if isinstance(v, torch.Tensor) and v.dim())

    held = {"parameters": sum(p.numel() * p.element_size() for p in split),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in split if p.grad is not None),
            "optimizer_state": state_bytes(split)}
    sharded = {"parameters": sum(s.numel() * s.element_size() for s in shards),
               "gradients": sum(s.grad.numel() * s.grad.element_size() for s in shards),
               "optimizer_state": state_bytes(shards)}
    reported = strategy.memory_bytes()
    steps = sum(v.untyped_storage().nbytes() for state in strategy.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and not v.dim())  # AdamW's step counts
    strategy.zero_grad()
    trainer.close_mesh()
    seen = collectives.allgather_object((held, sharded), name="ep.fsdp.bytes")

    assert all(counts == seen[0] for counts in seen)
    assert 0 <= padding < world.size * len(strategy.buckets)
    assert held == {"parameters": whole // 2, "gradients": whole // 2, "optimizer_state": 2 * (whole // 2)}
    own = (rest + padding) // world.size * size
    assert sharded == {"parameters": own, "gradients": own, "optimizer_state": 2 * own}
    assert reported == {"parameters": whole // 2 + own, "gradients": whole // 2 + own,
                        "optimizer_state": 2 * (whole // 2 + own) + steps}


@pytest.mark.timeout(300)
def test_a_checkpoint_holds_the_experts_whole_and_resumes_under_ddp_at_any_expert_parallel(world, shared_tmp_path):
    """Mixtral at fsdp x E=2 writes a full checkpoint (every expert once, gathered whole, and its AdamW
    moments, under one process's names and indices), which resumes bitwise under fsdp x E=2, under ddp
    at E=1 and at E=2; the gathered state loads into a fresh fsdp x E=2 model bitwise, and the exported
    directory loads in plain transformers and as pretrained weights at fsdp x E=2 to the same tensors."""
    from pathlib import Path

    from tests.mpi.test_hf_moe import make_model, make_trainer, token_data
    from tests.mpi.test_mesh_checkpoint import differences

    even_world(world)
    directory, data, steps = shared_tmp_path / "ckpt", token_data(), 2

    def trainer_in(path, seed, **layout):
        return make_trainer(world, make_model("mixtral", seed), data, max_steps=steps, checkpoint_dir=str(path),
                            **layout)

    written = trainer_in(directory, 100 + world.rank, strategy="fsdp", expert_parallel=2)
    written.fit()
    saved = written.strategy.state_dict()
    written.export_hf(Path(directory) / "hf")
    resumed = {}
    for name, layout in (("fsdp E2", {"strategy": "fsdp", "expert_parallel": 2}), ("ddp E1", {}),
                         ("ddp E2", {"expert_parallel": 2})):
        trainer = trainer_in(directory, 200, **layout)  # resumes step 2 of 2: nothing left to train
        trainer.fit()
        resumed[name] = differences(trainer.strategy.state_dict(), saved)
        trainer.close_mesh()
    fresh = make_trainer(world, make_model("mixtral", 300), data, strategy="fsdp", expert_parallel=2)
    fresh.strategy.load_state_dict(saved)
    resumed["loaded whole"] = differences(fresh.strategy.state_dict(), saved)
    fresh.close_mesh()
    pretrained = make_trainer(world, make_model("mixtral", 400), data, strategy="fsdp", expert_parallel=2)
    # weights only: each rank takes its experts, fsdp its shards
    resumed["pretrained"] = pretrained_differences(pretrained, Path(directory) / "hf", saved)
    pretrained.close_mesh()
    written.close_mesh()
    exported = exported_differences(world, Path(directory) / "hf", saved, name="ep.fsdp.exported")

    name = "model.layers.0.mlp.experts.gate_up_proj"
    index = [n for n, _ in make_model("mixtral", 0).named_parameters()].index(name)  # the optimizer's numbering
    assert tuple(saved["model"][name].shape) == (4, 2 * 48, 32), "gathered whole: every expert"
    assert saved["optimizer"]["state"][index]["exp_avg"].shape == saved["model"][name].shape, \
        "the experts' AdamW moments gathered whole, at one process's index"
    assert resumed == {"fsdp E2": [], "ddp E1": [], "ddp E2": [], "loaded whole": [], "pretrained": []}
    assert exported == []

"""Expert parallelism (train.expert_parallel=E): Hugging Face mixture-of-experts decoders whose fused
experts are split over E ranks, each with its own data, take one process's steps. Qwen2-MoE (its shared
expert and gate whole), Qwen3-MoE (one dense layer) and Mixtral (the load-balancing loss in the loss),
the families and toy shapes of test_hf_moe.py; E=2 at 2 ranks, E=4 and E=2 x 2 replica groups at 4.

The reference is test_hf_moe.py's: one process, each step one micro-batch per data rank (every rank
is one here), gradients averaged. Float64 with transformers' eager experts (grouped_mm has no float64
kernel), 3 AdamW steps, bound 1e-10, for the reasons test_hf_moe.py gives: the layouts differ only in
the order of float64 additions (the experts' tokens summed on their owner, the replica average),
while an expert averaged with another rank's experts, a token sent to the wrong owner or a routing
weight lost moves the weights by more than 1e-4 (checked: how far training moved every expert).
"""
import pytest
import torch

from hvdtrain.distributed import collectives
from hvdtrain.verify.exact import float64_throughout
from tests.mpi.test_hf_moe import EXAMPLE, FAMILIES, differences_from_one_process, expert_names, train

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.mpi, pytest.mark.process_sets,
              pytest.mark.np4(reason="E=4, and E=2 with two replica groups of each expert, fit only at 4 ranks")]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("experts", [2, 4])
@pytest.mark.parametrize("family", [*FAMILIES, EXAMPLE])
def test_split_experts_take_one_process_steps(world, family, experts):
    if world.size % experts:
        pytest.skip(f"expert_parallel={experts} needs a world that divides by it")
    if world.size > 2 and family not in ({2: "mixtral", 4: "qwen3_moe"}[experts], EXAMPLE):
        pytest.skip("past 2 ranks one family per E (and hvdtrain's own): what the families differ in, 2 ranks check")
    with float64_throughout():
        trainer, data, initial, final, step_losses = train(world, family, expert_parallel=experts)
        local = {name: p for name, p in trainer.model.named_parameters() if hasattr(p, "expert_shard")}
        held = {name: tuple(p.shape) for name, p in local.items()}
        trainer.close_mesh()
        worst, loss_error, moved, experts_moved = differences_from_one_process(family, data, initial, final,
                                                                              step_losses, world.size)
    print(f"\n{family} E={experts} at {world.size} ranks: max |param - one process| {worst:.2e}, "
          f"max |loss - one process| {loss_error:.2e}, experts moved >= {experts_moved:.2e}")

    assert moved > 1e-4, "training did not move every weight: the test proves nothing"
    assert loss_error < 1e-10, f"per-step loss against one process: {loss_error}"
    assert worst < 1e-10, f"max |gathered - one process| = {worst}"
    # Every expert parameter is split, 1/E of the experts each, gathered whole under its own name;
    # routers, the shared expert and its gate stay whole.
    assert expert_names(final) and sorted(held) == expert_names(final)
    for name, shape in held.items():
        assert shape[0] * experts == final[name].shape[0] and shape[1:] == tuple(final[name].shape[1:])
    assert not any(".mlp.gate." in name or "shared_expert" in name for name in held)


@pytest.mark.timeout(240)
def test_each_rank_holds_one_eth_of_the_experts_state(world):
    """Bytes of expert parameters, gradients (after a backward and the reduction) and AdamW state on
    each rank at E=2: half of what the whole experts take; the strategy's own count is the rest of
    the model whole plus that half."""
    import contextlib

    from tests.mpi.test_hf_moe import moe_step, token_data

    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    trainer, _, _, final, _ = train(world, "mixtral", max_steps=1, expert_parallel=2)
    strategy = trainer.strategy
    data = token_data()
    strategy.forward_backward(moe_step, (data.tensors[0][:4], data.tensors[1][:4]), contextlib.nullcontext,
                              lambda loss: loss, 1)
    strategy.synchronize()
    split = [p for p in trainer.model.parameters() if hasattr(p, "expert_shard")]
    whole = sum(final[name].numel() * final[name].element_size() for name in expert_names(final))
    rest = sum(t.numel() * t.element_size() for name, t in final.items() if name not in expert_names(final))
    held = {
        "parameters": sum(p.numel() * p.element_size() for p in split),
        "gradients": sum(p.grad.numel() * p.grad.element_size() for p in split if p.grad is not None),
        "optimizer_state": sum(v.numel() * v.element_size() for p in split
                               for v in strategy.optimizer.state[p].values() if isinstance(v, torch.Tensor) and v.dim()),
    }
    reported = strategy.memory_bytes()
    steps = sum(v.untyped_storage().nbytes() for state in strategy.optimizer.state.values() for v in state.values()
                if isinstance(v, torch.Tensor) and not v.dim())  # AdamW's step counts
    strategy.zero_grad()
    trainer.close_mesh()
    seen = collectives.allgather_object(held, name="ep.bytes")

    assert all(counts == seen[0] for counts in seen)
    assert held == {"parameters": whole // 2, "gradients": whole // 2, "optimizer_state": 2 * (whole // 2)}
    assert reported == {"parameters": whole // 2 + rest, "gradients": whole // 2 + rest,
                        "optimizer_state": 2 * (whole // 2 + rest) + steps}


def pretrained_differences(trainer, directory, saved):
    """The names whose weights ``trainer`` holds, after loading ``directory`` as pretrained weights,
    other than the ``saved`` state's."""
    trainer.load_pretrained(directory)
    weights = trainer.strategy.state_dict()["model"]
    return [name for name in saved["model"] if not torch.equal(weights[name], saved["model"][name])]


def exported_differences(world, directory, saved, name):
    """The names plain transformers loads from the exported ``directory`` other than the ``saved``
    state's (rank 0 loads; every rank gets its answer by the broadcast ``name``)."""
    exported = None
    if world.is_root:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64)
        exported = [key for key, t in loaded.state_dict().items() if not torch.equal(t, saved["model"][key])]
    return collectives.broadcast_object(exported, root_rank=0, name=name)


@pytest.mark.timeout(300)
def test_a_checkpoint_holds_the_experts_whole_and_resumes_at_any_expert_parallel(world, shared_tmp_path):
    """Qwen2-MoE at E=2 writes a full checkpoint (every expert once, gathered whole, under the
    model's own names), which resumes bitwise at E=2 and at E=1 (plain ddp); the gathered state
    loads into a fresh E=2 model bitwise, and the exported directory loads in plain transformers
    and as pretrained weights at E=2 (each rank reading its experts' rows) to the same tensors."""
    from pathlib import Path

    from tests.mpi.test_hf_moe import make_model, make_trainer, token_data
    from tests.mpi.test_mesh_checkpoint import differences

    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    directory, data, steps = shared_tmp_path / "ckpt", token_data(), 2

    def trainer_in(path, seed, **layout):
        return make_trainer(world, make_model("qwen2_moe", seed), data, max_steps=steps, checkpoint_dir=str(path),
                            **layout)

    written = trainer_in(directory, 100 + world.rank, expert_parallel=2)
    written.fit()
    saved = written.strategy.state_dict()
    written.export_hf(Path(directory) / "hf")
    resumed = {}
    for name, layout in (("E2", {"expert_parallel": 2}), ("E1", {})):
        trainer = trainer_in(directory, 200, **layout)  # resumes step 2 of 2: nothing left to train
        trainer.fit()
        resumed[name] = differences(trainer.strategy.state_dict(), saved)
        trainer.close_mesh()
    fresh = make_trainer(world, make_model("qwen2_moe", 300), data, expert_parallel=2)
    fresh.strategy.load_state_dict(saved)
    resumed["loaded whole at E2"] = differences(fresh.strategy.state_dict(), saved)
    fresh.close_mesh()
    pretrained = make_trainer(world, make_model("qwen2_moe", 400), data, expert_parallel=2)
    # weights only: each rank takes its experts
    resumed["pretrained at E2"] = pretrained_differences(pretrained, Path(directory) / "hf", saved)
    pretrained.close_mesh()
    written.close_mesh()
    exported = exported_differences(world, Path(directory) / "hf", saved, name="ep.exported")

    shape = saved["model"]["model.layers.0.mlp.experts.gate_up_proj"].shape
    assert tuple(shape) == (4, 2 * 16, 32), "gathered whole: every expert, [gate; up] of 2 x 16 rows"
    assert resumed == {"E2": [], "E1": [], "loaded whole at E2": [], "pretrained at E2": []}
    assert exported == []


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero2", "fsdp"])
def test_clipping_counts_every_expert_once(world, strategy):
    """Mixtral at E=2 (under ddp, and under zero1, zero2 and fsdp: their slices of the rest each counted
    by their rank)
    with train.max_grad_norm below the gradients' norm: the global norm counts each expert once (its
    replicas hold the same averaged gradient) and every replicated gradient once, so the steps are
    one process's clipped ones (a norm counting a rank's own experts only, or counting the
    replicated gradients once per rank, scales the steps otherwise: by 1e-4 and more)."""
    from tests.mpi.test_hf_moe import STEPS, BATCH, data_ranks_orders, make_model, moe_step

    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    max_norm = 0.05
    with float64_throughout():
        # SGD: its step is proportional to the clipped gradient (Adam's would all but ignore the scale)
        trainer, data, initial, final, _ = train(world, "mixtral", torch.optim.SGD, 0.1, expert_parallel=2,
                                                 max_grad_norm=max_norm, strategy=strategy)
        trainer.close_mesh()
        model = make_model("mixtral", 0)
        model.load_state_dict(initial)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        orders, norms = data_ranks_orders(len(data), world.size), []
        for step in range(STEPS):
            optimizer.zero_grad()
            for order in orders:
                batch = order[step * BATCH:(step + 1) * BATCH]
                loss, _ = moe_step(model, (data.tensors[0][batch], data.tensors[1][batch]))
                (loss / len(orders)).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
            optimizer.step()
    worst = max((final[name] - t).abs().max().item() for name, t in model.state_dict().items())
    print(f"\nmixtral {strategy} x E=2 clipped to {max_norm}: norms {norms}, max |param - one process| {worst:.2e}")

    assert min(norms) > 2 * max_norm, "the gradients were not clipped: the test proves nothing"
    assert worst < 1e-10, worst


@pytest.mark.timeout(240)
def test_ranks_that_made_different_numbers_of_collectives_before_still_meet(world):
    """Every all-to-all of the dispatch is named, its gradient's too. Horovod's own autograd names the
    backward's ``alltoall.noname.<handle>`` by a per-process counter: after rank 0 alone made one more
    collective (as a pipeline stage or an earlier test does), the ranks waited for each other under
    different names until Horovod shut down (found by the 4-rank suite)."""
    if world.size % 2:
        pytest.skip("expert_parallel=2 needs an even world")
    import horovod.torch as hvd
    from hvdtrain.parallel.topology import PROCESS_SETS
    alone = PROCESS_SETS.acquire((0,), world.size)  # every rank makes it; rank 0 alone uses it
    if world.rank == 0:
        hvd.allreduce(torch.ones(1), process_set=alone)  # unnamed: only rank 0's counter moves on
    PROCESS_SETS.release((0,))
    with float64_throughout():
        trainer, data, initial, final, step_losses = train(world, "mixtral", expert_parallel=2)
        trainer.close_mesh()
        worst, loss_error, moved, _ = differences_from_one_process("mixtral", data, initial, final, step_losses,
                                                                   world.size)
    assert moved > 1e-4 and loss_error < 1e-10 and worst < 1e-10, (worst, loss_error, moved)

"""Megatron tensor parallelism is right when T ranks splitting every block compute the loss, every
gradient and every Adam step of one process's full model on the same batch, and D data groups of T
ranks, fed different batches and averaging their gradients, match that model on the whole batch."""
import pytest
import torch
import horovod.torch as hvd

from hvdtrain.distributed import collectives
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.examples.textlm_parallel import parallelize_tensor
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.tensor.layers import copy_to_tensor_group, full_tensor, reduce_from_tensor_group

# The launches of scripts/run_tests.sh this file runs in besides the one at $NP ranks under MPI,
# each with what it shows there (the markers: setup.cfg).
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.process_sets,
    pytest.mark.np1(reason="T=1: the split code with a tensor group of one rank"),
    pytest.mark.np4(reason="D=2 data groups of T=2 ranks and T=4 fit only at 4 ranks"),
    pytest.mark.gloo_np4(reason="the mesh's process sets over Gloo: 4 ranks fit every layout, and Gloo's dynamic "
                                "process sets are another implementation of the groups"),
]

VOCAB, SEQ, ROWS, STEPS = 20, 16, 4, 3  # ROWS: the global batch, cut among the data groups


def new_model() -> TinyTransformerLM:
    torch.manual_seed(7)
    return TinyTransformerLM(VOCAB, seq_len=SEQ, d_model=32, layers=2, heads=4, dropout=0.0).double()


def global_batch(step: int):
    ids = torch.randint(0, VOCAB, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return ids[:, :-1], ids[:, 1:]


def build_mesh(world, tensor: int) -> Mesh:
    if world.size % tensor:  # the same decision on every rank
        pytest.skip(f"tensor_parallel={tensor} does not divide {world.size} ranks")
    return Mesh.build(world.size, world.rank, tensor=tensor)


def differences(model, reference, gradients: bool) -> torch.Tensor:
    """Per parameter, max |local - its slice of the full model's| (of the gradients or the values)."""
    full = dict(reference.named_parameters())
    out = []
    for name, p in model.named_parameters():
        ours, theirs = (p.grad, full[name].grad) if gradients else (p.detach(), full[name].detach())
        shard = getattr(p, "tensor_shard", None)
        out.append((ours - (theirs if shard is None else shard.take(theirs))).abs().max())
    return torch.stack(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_tensor_and_data_groups_match_one_process_with_the_whole_batch(world, tensor):
    mesh = build_mesh(world, tensor)
    try:
        data, data_size = mesh.coordinates.data, mesh.shape.data
        model = parallelize_tensor(new_model(), mesh.tensor)
        reference = new_model()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
        split = [(n, p) for n, p in model.named_parameters() if hasattr(p, "tensor_shard")]
        replicated = [(n, p) for n, p in model.named_parameters() if not hasattr(p, "tensor_shard")]
        loss_errors, grad_errors, gathered_errors, replica_spread = [], [], [], []
        for step in range(STEPS):
            inputs, targets = global_batch(step)
            rows = slice(data * ROWS // data_size, (data + 1) * ROWS // data_size)  # this data group's rows
            optimizer.zero_grad()
            loss = lm_loss(model(inputs[rows]), targets[rows])
            loss.backward()
            # The claim of the tensor module's docstring: replicated gradients (LayerNorms, embeddings,
            # the tied head, row biases) equal on every rank of a tensor group, before any communication.
            rows_of_world = collectives.allgather_rows(torch.cat([p.grad.reshape(-1) for _, p in replicated]),
                                                       name=f"tp.test.replicated.{step}")
            mine = rows_of_world[world.rank]
            replica_spread.append(max((rows_of_world[r] - mine).abs().max() for r in mesh.tensor.ranks))
            # Data parallelism by hand: average the loss and every gradient over the data group.
            if mesh.data.process_set is not None:
                loss = hvd.allreduce(loss.detach(), op=hvd.Average, name=f"tp.test.loss.{step}",
                                     process_set=mesh.data.process_set)
                grads = [p.grad for p in model.parameters()]
                flat = hvd.allreduce(torch.cat([g.reshape(-1) for g in grads]), op=hvd.Average,
                                     name=f"tp.test.grads.{step}", process_set=mesh.data.process_set)
                for g, averaged in zip(grads, flat.split([g.numel() for g in grads])):
                    g.copy_(averaged.view_as(g))
            reference_optimizer.zero_grad()
            reference_loss = lm_loss(reference(inputs), targets)
            reference_loss.backward()
            loss_errors.append((loss.detach() - reference_loss.detach()).abs())
            grad_errors.append(differences(model, reference, gradients=True).max())
            if step == 0:  # full gradients gathered from the slices (TensorShard.place + sum over the group)
                full_grads = dict((n, p.grad) for n, p in reference.named_parameters())
                gathered_errors.append(max(
                    (full_tensor(p.grad, p.tensor_shard, mesh.tensor, f"tp.test.gather.{n}") - full_grads[n]).abs().max()
                    for n, p in split))
            optimizer.step()
            reference_optimizer.step()
        parameter_error = differences(model, reference, gradients=False).max()
        local = torch.stack([torch.stack(loss_errors).max(), torch.stack(grad_errors).max(),
                             torch.stack(gathered_errors).max(), parameter_error,
                             torch.stack(replica_spread).max()]).double()
        everywhere = collectives.allgather_rows(local, name="tp.test.result").max(dim=0).values
    finally:
        mesh.close()
    loss_error, grad_error, gathered_error, parameter_error, spread = everywhere.tolist()
    assert list(model.state_dict()) == list(reference.state_dict())
    assert len(split) == 12  # per block: qkv weight, bias; proj weight; mlp.0 weight, bias; mlp.2 weight
    assert loss_error < 1e-10, loss_error
    assert grad_error < 1e-10, grad_error
    assert gathered_error < 1e-10, gathered_error
    assert parameter_error < 1e-10, parameter_error
    assert spread == 0.0, spread  # identical, not merely close
    assert model.blocks[0].attention.heads == 4 // tensor


@pytest.mark.timeout(60)
def test_f_copies_forward_and_sums_backward_g_the_reverse(world):
    mesh = build_mesh(world, world.size)
    try:
        group, size = mesh.tensor, mesh.tensor.size
        x = torch.full((3,), float(world.rank + 1), dtype=torch.float64, requires_grad=True)
        f_out = copy_to_tensor_group(x, group, "tp.test.f")
        (f_out * (world.rank + 1)).sum().backward()
        f_grad, x.grad = x.grad.clone(), None
        g_out = reduce_from_tensor_group(x, group, "tp.test.g")
        (g_out * (world.rank + 1)).sum().backward()
        g_grad = x.grad.clone()
        result = collectives.allgather_rows(torch.cat([f_out.detach(), f_grad, g_out.detach(), g_grad]), name="tp.test.fg")
    finally:
        mesh.close()
    ranks_sum = size * (size + 1) / 2  # sum of (rank + 1) over the group (the whole world here)
    mine = result[world.rank].reshape(4, 3)
    assert mine[0].tolist() == [world.rank + 1] * 3  # f forward: identity
    assert mine[1].tolist() == [ranks_sum] * 3  # f backward: the group's sum
    assert mine[2].tolist() == [ranks_sum] * 3  # g forward: the group's sum
    assert mine[3].tolist() == [world.rank + 1] * 3  # g backward: identity

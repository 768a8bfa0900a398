"""Expert parallelism: a mixture-of-experts layer's fused experts split over E data-parallel ranks.

The E ranks of an expert group are E consecutive ranks of the data-parallel world, each with its own
data; rank e of the group holds experts [e n/E, (e+1) n/E) of every fused experts module (transformers
5 keeps a family's experts in one module with 3-D parameters, experts first: ``gate_up_proj``,
``down_proj``). The router, its top-k, its load-balancing loss and a shared expert stay whole and
replicated, so routing is the model's own. In the experts' forward, ``experts(hidden_states,
top_k_index, top_k_weights)``, every rank sends each (token, chosen expert) pair to the expert's
owner with an all-to-all (uneven splits: Horovod exchanges the counts per destination first), the
owner runs the module's own forward (its class's, any experts implementation) on its slice of the
experts and on what it received, the results come back by the reverse all-to-all, and the sender
adds them per token as the module does (pairs sorted by expert, so in the module's order). Backward
sends the gradients the same ways back, by all-to-alls named as the forward's (_NamedAlltoalls, one fixed order on every rank).

Gradients: with the loss the mean of the N ranks' losses, an expert's gradient is 1/N of the sum
over every token routed to it from every rank. Its owner's local gradient already sums its expert
group's tokens, so the experts are left out of the data-parallel average and averaged instead over
the N/E ranks that hold the same experts (stride E), then divided by E (ExpertGroups.replica).

A split parameter keeps its state_dict name and carries ``expert_shard`` (a TensorShard along dim 0),
so checkpoints, exports and the memory count can tell the whole from the slice.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch
from torch import nn

from hvdtrain.distributed import startup
from hvdtrain.parallel.mesh import Group, Ranks, acquire_process_set, release_process_set
from hvdtrain.parallel.tensor import own_copy
from hvdtrain.parallel.tensor_shard import TensorShard


def expert_group_ranks(world_size: int, rank: int, size: int) -> Ranks:
    """The E consecutive ranks whose experts together make every expert, ``rank`` among them."""
    start = rank - rank % size
    return tuple(range(start, start + size))


def replica_group_ranks(world_size: int, rank: int, size: int) -> Ranks:
    """The ranks holding the same experts as ``rank``: one per expert group (stride E)."""
    return tuple(range(rank % size, world_size, size))


def check_world(world_size: int, size: int) -> None:
    """ValueError unless E = ``size`` ranks per expert group divide the world."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"train.expert_parallel must be a whole number >= 1, got {size!r}")
    if world_size % size:
        fits = [n for n in range(size, 4 * size + 1, size)]
        raise ValueError(f"train.expert_parallel={size} does not divide the {world_size} workers: each expert group "
                         f"is {size} ranks of the data-parallel world; run {' or '.join(map(str, fits[:3]))} "
                         f"workers, or choose an expert_parallel dividing {world_size}")


class ExpertGroups:
    """This rank's expert group (all-to-all) and replica group (the experts' gradient average), with
    their Horovod process sets. ``build`` and ``close`` are collectives over the whole world.

    Args:
        size: E, ranks per expert group.
        expert: this rank's expert group (its all-to-alls).
        replica: the ranks holding the same experts (their gradients' average).
        added: the process sets this object holds a count of (released by close).
    """

    def __init__(self, size: int, expert: Group, replica: Group, added: List[Ranks]) -> None:
        self.size, self.expert, self.replica, self._added = size, expert, replica, added

    @classmethod
    def build(cls, world_size: int, rank: int, size: int) -> "ExpertGroups":
        """Every rank adds the same process sets in the same order (hvd.add_process_set is a collective).

        Args:
            world_size: ranks in the world.
            rank: this rank.
            size: E, ranks per expert group.
        """
        check_world(world_size, size)
        groups: List[Ranks] = []
        for r in range(world_size):
            for ranks in (expert_group_ranks(world_size, r, size), replica_group_ranks(world_size, r, size)):
                if len(ranks) > 1 and ranks not in groups:
                    groups.append(ranks)
        if any(len(g) < world_size for g in groups) and not startup.dynamic_process_sets_enabled():
            raise ValueError(startup.dynamic_process_sets_conflict())
        sets: Dict[Ranks, Any] = {}
        added: List[Ranks] = []
        for ranks in groups:
            sets[ranks] = acquire_process_set(ranks, world_size)  # shared with a live mesh's set of the same ranks
            if len(ranks) < world_size:
                added.append(ranks)
        expert = expert_group_ranks(world_size, rank, size)
        replica = replica_group_ranks(world_size, rank, size)
        return cls(size, Group(expert, rank, sets.get(expert)), Group(replica, rank, sets.get(replica)), added)

    def close(self) -> None:
        """Remove the process sets no live mesh or other expert groups use (a collective)."""
        for ranks in self._added:
            release_process_set(ranks)
        self._added = []


# What a Hugging Face config calls the experts each token is routed to, family by family.
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")


def experts_per_token(config: Any) -> Optional[int]:
    """The routed experts per token a model's config names (top-k), or None when it names none."""
    return next((getattr(config, key) for key in TOP_K_KEYS if isinstance(getattr(config, key, None), int)), None)


def fused_experts(model: nn.Module) -> Dict[str, nn.Module]:
    """Path -> module of every fused experts module: one declaring ``num_experts`` whose own
    parameters are 3-D with the experts first (transformers 5's ``gate_up_proj`` and ``down_proj``)."""
    found = {}
    for path, module in model.named_modules():
        own = dict(module.named_parameters(recurse=False))
        count = getattr(module, "num_experts", None)
        if isinstance(count, int) and own and any(p.dim() == 3 for p in own.values()):
            found[path] = module
    return found


def check_experts(path: str, module: nn.Module, size: int) -> None:
    """ValueError naming ``path`` when its experts cannot be dealt out over E = ``size`` ranks."""
    name, count = type(module).__name__, module.num_experts
    if count % size:
        raise ValueError(f"expert parallelism: {path} ({name}) has {count} experts, not divisible by "
                         f"train.expert_parallel={size}: each rank of an expert group holds an equal share; choose "
                         f"an expert_parallel dividing {count}")
    own = dict(module.named_parameters(recurse=False))
    odd = [f"{p} {tuple(t.shape)}" for p, t in own.items() if t.dim() < 1 or t.shape[0] != count]
    if odd:
        raise ValueError(f"expert parallelism: {path} ({name}) holds parameters that are not one row per expert "
                         f"({', '.join(odd)}, {count} experts): hvdtrain deals out fused experts whose every "
                         f"parameter has the experts first")
    if any(True for child in module.children() for _ in child.parameters()):
        raise ValueError(f"expert parallelism: {path} ({name}) holds experts as submodules with parameters, not "
                         f"fused 3-D parameters: hvdtrain splits transformers 5's fused experts only")
    if any(hasattr(p, "expert_shard") for p in own.values()):
        raise ValueError(f"expert parallelism: {path} is already split: parallelize once")


def split_experts(module: nn.Module, groups: ExpertGroups, path: str) -> nn.Module:
    """A copy of the experts ``module`` (its class, its forward) holding this rank's experts, whose
    forward dispatches every (token, expert) pair to its owner and combines the results. The module
    as built is left as it was.

    Args:
        module: the fused experts module.
        groups: this rank's expert and replica groups.
        path: its path in the model, naming its collectives.
    """
    size, index = groups.size, groups.expert.index
    split = own_copy(module)
    shard = TensorShard(dim=0, parts=size, index=index)
    for attribute, parameter in module.named_parameters(recurse=False):
        local = nn.Parameter(shard.take(parameter.detach()), requires_grad=parameter.requires_grad)
        local.expert_shard = shard
        split._parameters[attribute] = local
    split.num_experts = module.num_experts // size
    split.forward = _Dispatch(split, module.num_experts, groups.expert, path)
    return split


class _NamedAlltoalls(torch.autograd.Function):
    """Horovod's all-to-all of several tensors cut by the same splits, their gradients' all-to-alls named
    too and sent back in one fixed order. Horovod's own autograd names the backward's
    ``alltoall.noname.<handle>``, a per-process counter: ranks that had made different numbers of
    collectives before (a pipeline's stages, a test suite) waited for each other under different names.
    And one autograd node per tensor let each rank's backward run them in its own order (autograd
    orders independent branches by the graph the rank built, and a rank on which an expert received
    no token builds another): rank 0 waited in the hidden states' gradient, rank 1 in the routing
    weights', forever."""

    @staticmethod
    def forward(ctx, splits, process_set, names, *tensors):
        outputs, received = [], splits
        for tensor, name in zip(tensors, names):
            output, received = hvd.alltoall(tensor.contiguous(), splits=splits, name=name, process_set=process_set)
            outputs.append(output)
        ctx.received, ctx.process_set, ctx.names = received, process_set, names
        ctx.mark_non_differentiable(received)
        return (*outputs, received)

    @staticmethod
    def backward(ctx, *grads):
        back = []
        for grad, name in zip(grads[:-1], ctx.names):  # every rank, every tensor, in this order
            sent, _ = hvd.alltoall(grad.contiguous(), splits=ctx.received, name=f"{name}.grad",
                                   process_set=ctx.process_set)
            back.append(sent)
        return (None, None, None, *back)


def _alltoall(tensors: Sequence[torch.Tensor], splits: torch.Tensor, group: Group,
              names: Sequence[str]) -> Tuple[List[torch.Tensor], torch.Tensor]:
    """Each of ``tensors`` cut by ``splits`` and exchanged over ``group`` (see _NamedAlltoalls): what
    this rank received of each, and how many rows from each rank."""
    if group.process_set is None:  # a group of one rank: everything stays here
        return list(tensors), splits
    *outputs, received = _NamedAlltoalls.apply(splits, group.process_set, tuple(names), *tensors)
    return outputs, received


class _Dispatch:
    """The split experts' forward: send, compute with the module's own forward, send back, combine."""

    def __init__(self, module: nn.Module, total: int, group: Group, name: str) -> None:
        self.module, self.total, self.group, self.name = module, total, group, name

    def __call__(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        per_rank, device = self.total // self.group.size, hidden_states.device
        tokens, k = top_k_index.shape
        experts = top_k_index.reshape(-1)
        token = torch.arange(tokens, device=device).repeat_interleave(k)
        slot = torch.arange(k, device=device).repeat(tokens)
        # An index outside [0, n) is a dropped pair (transformers' sentinel n): the module adds nothing for it.
        kept = (experts >= 0) & (experts < self.total)
        experts, token, slot = experts[kept], token[kept], slot[kept]
        order = torch.sort(experts, stable=True).indices  # by expert: by owner, and in the module's order
        experts, token, slot = experts[order], token[order], slot[order]
        owner = torch.div(experts, per_rank, rounding_mode="floor")
        splits = torch.bincount(owner, minlength=self.group.size).to(torch.int32).cpu()
        name = f"ep.{self.name}"
        # The hidden states and routing weights in one exchange, whose backward sends both gradients
        # back in one order on every rank; the experts' indices carry no gradient.
        (received, weights), received_splits = _alltoall(
            (hidden_states[token], top_k_weights[token, slot]), splits, self.group, (f"{name}.hidden", f"{name}.weights"))
        (local,), _ = _alltoall((experts - owner * per_rank,), splits, self.group, (f"{name}.experts",))
        computed = type(self.module).forward(self.module, received, local.unsqueeze(1), weights.unsqueeze(1),
                                             *args, **kwargs)
        if received.requires_grad and not computed.requires_grad:
            # No pair reached this rank's experts: the way back must still carry the others' gradients.
            computed = computed + received.sum() * 0
        (returned,), _ = _alltoall((computed,), received_splits, self.group, (f"{name}.combine",))
        combined = torch.zeros_like(hidden_states)
        return combined.index_add_(0, token, returned.to(combined.dtype))


def expert_parameters(model: nn.Module) -> List[Tuple[str, nn.Parameter]]:
    """(name, parameter) of every split expert parameter in ``model``."""
    return [(n, p) for n, p in model.named_parameters() if hasattr(p, "expert_shard")]


def whole_shape(tensor: torch.Tensor) -> torch.Size:
    """The whole parameter's shape of a split one (the tensor's own shape otherwise)."""
    shard: Optional[TensorShard] = getattr(tensor, "expert_shard", None)
    if shard is None:
        return tensor.shape
    return torch.Size((tensor.shape[0] * shard.parts,) + tuple(tensor.shape[1:]))


def average_over_replicas_async(gradient: torch.Tensor, groups: ExpertGroups, name: str) -> Optional[int]:
    """Start making an expert parameter's ``gradient`` one process's, in place: averaged over its
    replica group, divided by E (see the module's docstring). The Horovod handle to wait on, or None
    when the replica group is this rank alone (only the division, done here)."""
    if groups.replica.process_set is None:
        gradient.div_(groups.size)
        return None
    return hvd.allreduce_async_(gradient, name=name, op=hvd.Average, postscale_factor=1.0 / groups.size,
                                process_set=groups.replica.process_set)


def _whole_sized(value: Any, shape: torch.Size) -> bool:
    """Per-element optimizer state of a whole expert parameter (Adam's moments), not a scalar (its step)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape


def cut_state(state: Dict[str, Any], share: torch.Tensor) -> Dict[str, Any]:
    """An optimizer's state of a whole expert parameter with its per-element entries cut to this
    rank's ``share`` (entries of another shape, scalars included, as they are)."""
    whole = whole_shape(share)
    return {key: share.expert_shard.take(value) if _whole_sized(value, whole) else value
            for key, value in state.items()}


def gather_state(state: Dict[str, Any], share: torch.Tensor, group: Group, name: str) -> Dict[str, Any]:
    """An optimizer's state of this rank's ``share`` with its per-element entries gathered whole (a
    collective over the expert group): a new dict, so that torch's live state is left alone.

    Args:
        state: the optimizer's state of the share.
        share: this rank's expert parameter.
        group: its expert group.
        name: prefixes each entry's collective.
    """
    return {key: gather_whole(value, group, f"{name}.{key}") if _whole_sized(value, share.shape) else value
            for key, value in sorted(state.items())}


def gather_whole(local: torch.Tensor, group: Group, name: str) -> torch.Tensor:
    """The whole tensor of an expert group's slices along dim 0 (a collective over the group)."""
    if group.process_set is None:
        return local.detach().clone()
    return hvd.allgather(local.detach().contiguous(), name=name, process_set=group.process_set)

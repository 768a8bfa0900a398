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
Two families call their experts otherwise, and are dispatched by rows (_SortedDispatch): JetMoe with
rows already sorted by expert and each expert's count, ``experts(rows, rows_per_expert)``, and Llama 4
with every token once per expert, expert-major, ``experts(rows)``; each owner gets its experts' rows.
A module called in none of these ways is refused at set-up (check_experts, call_layout).

Gradients: with the loss the mean of the N ranks' losses, an expert's gradient is 1/N of the sum
over every token routed to it from every rank. Its owner's local gradient already sums its expert
group's tokens, so the experts are left out of the data-parallel average and averaged instead over
the N/E ranks that hold the same experts (stride E), then divided by E (ExpertGroups.replica).

A split parameter keeps its state_dict name and carries ``expert_shard`` (a TensorShard along dim 0),
so checkpoints, exports and the memory count can tell the whole from the slice.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch
from torch import nn

from hvdtrain.parallel.mesh import Group, OwnedGroups, Ranks
from hvdtrain.parallel.tensor.layers import own_copy
from hvdtrain.parallel.tensor.shard import TensorShard


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


class ExpertGroups(OwnedGroups):
    """This rank's expert group (all-to-all) and replica group (the experts' gradient average), with
    their Horovod process sets: a view of a topology's groups (hvdtrain.parallel.topology makes and
    removes every process set).

    Args:
        size: E, ranks per expert group.
        expert: this rank's expert group (its all-to-alls).
        replica: the ranks holding the same experts (their gradients' average).
        owner: the topology ``close`` closes (one made for these groups alone); None: the topology's owner
            closes it.
    """

    def __init__(self, size: int, expert: Group, replica: Group, owner: Any = None) -> None:
        self.size, self.expert, self.replica, self._owner = size, expert, replica, owner

    @classmethod
    def of(cls, world: Any, size: int, topology: Any = None) -> "ExpertGroups":
        """This rank's expert groups of E = ``size``, from ``topology`` (extended with them if it has none: a
        collective, every rank alike), or from a topology of their own when given none (a strategy built
        without one), which ``close`` closes.

        Args:
            world: this rank's World.
            size: E, ranks per expert group.
            topology: the run's Topology, or None.
        """
        check_world(world.size, size)
        return cls._asked(world, topology, "experts", experts=size)


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
    if call_layout(module) is None:
        raise ValueError(f"train.expert_parallel={size}: {path} ({name}) is called as forward"
                         f"{_signature(module)}, none of the calls the all-to-all dispatch routes (experts("
                         f"hidden_states, top_k_index, top_k_weights); experts(rows sorted by expert, rows per "
                         f"expert); experts(every token once per expert, expert-major)); use expert_parallel=1")


# How a family's model calls its fused experts module (read from the forward's positional parameters):
# ROUTED, experts(hidden_states, top_k_index, top_k_weights), each token with its top-k experts and
# weights (most families); SORTED, experts(rows, rows_per_expert), rows already sorted by expert with
# the count of each expert's (JetMoe's JetMoeParallelExperts: a linear map per expert, its router
# having sorted them); EXPERT_MAJOR, experts(rows), every token once per expert, expert 0's tokens
# first, each as many (Llama 4's Llama4TextExperts: the router's weights already multiplied in).
ROUTED, SORTED, EXPERT_MAJOR = "routed", "sorted", "expert-major"
_LAYOUTS = {1: EXPERT_MAJOR, 2: SORTED}


def call_layout(module: nn.Module) -> Optional[str]:
    """How ``module``'s forward is called (ROUTED, SORTED or EXPERT_MAJOR), or None when its
    signature is none of them (the dispatch cannot tell which rows go to which expert)."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return None
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p for p in parameters if p.kind in kinds]
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters) or not positional:
        return None
    return ROUTED if len(positional) >= 3 else _LAYOUTS[len(positional)]


def _signature(module: nn.Module) -> str:
    try:
        return str(inspect.signature(type(module).forward)).replace("self, ", "", 1)
    except (TypeError, ValueError):
        return "(?)"


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
    layout = call_layout(module)
    if layout == ROUTED:
        split.forward = _Dispatch(split, module.num_experts, groups.expert, path)
    else:
        split.forward = _SortedDispatch(split, module.num_experts, groups.expert, path, layout)
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
        routed = isinstance(top_k_index, torch.Tensor) and top_k_index.dim() == 2
        if not (routed and isinstance(top_k_weights, torch.Tensor)
                and tuple(top_k_weights.shape[:2]) == tuple(top_k_index.shape)):
            raise ValueError(f"expert parallelism: {self.name} ({type(self.module).__name__}) was called with "
                             f"{_described(top_k_index)} and {_described(top_k_weights)} where the dispatch routes "
                             f"(tokens, top-k) expert indices and weights; use train.expert_parallel=1")
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


def _described(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-D tensor {tuple(value.shape)}"
    return type(value).__name__


class _SortedDispatch:
    """The split experts' forward for a module called with its rows already sorted by expert (SORTED:
    with each expert's count; EXPERT_MAJOR: every expert the same count, rows / n). An owner's
    experts are consecutive, so are their rows: each owner's block is sent to it, with the counts of
    its experts; the owner puts what it received in its experts' order (expert by expert, the ranks
    in order within each), runs the module's own forward, puts the result back in the order it came
    in and returns it; the rows come back in this rank's own order. Each row is its own expert's
    image, as the module computes it whole."""

    def __init__(self, module: nn.Module, total: int, group: Group, name: str, layout: str) -> None:
        self.module, self.total, self.group, self.name, self.layout = module, total, group, name, layout

    def _counts(self, rows: torch.Tensor, args: Tuple[Any, ...]) -> torch.Tensor:
        """Each expert's count of ``rows`` (a CPU int64 tensor of n), or ValueError naming the module."""
        what = f"expert parallelism: {self.name} ({type(self.module).__name__})"
        if self.layout == EXPERT_MAJOR:
            if args or rows.dim() < 1 or rows.shape[0] % self.total:
                raise ValueError(f"{what} was called with {1 + len(args)} argument(s), rows {tuple(rows.shape)}, "
                                 f"not every token once per each of its {self.total} experts; use "
                                 f"train.expert_parallel=1")
            return torch.full((self.total,), rows.shape[0] // self.total, dtype=torch.int64)
        counts = args[0] if len(args) == 1 else None
        if isinstance(counts, torch.Tensor):
            counts = counts.reshape(-1).tolist()
        if not (isinstance(counts, (list, tuple)) and len(counts) == self.total
                and all(isinstance(c, int) and c >= 0 for c in counts) and sum(counts) == rows.shape[0]):
            raise ValueError(f"{what} was called with {_described(args[0]) if args else 'no counts'} where the "
                             f"dispatch routes rows sorted by expert and each of its {self.total} experts' count; "
                             f"use train.expert_parallel=1")
        return torch.tensor(counts, dtype=torch.int64)

    def __call__(self, rows: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        size, per_rank = self.group.size, self.total // self.group.size
        if kwargs:
            raise ValueError(f"expert parallelism: {self.name} ({type(self.module).__name__}) was called with "
                             f"{', '.join(sorted(kwargs))}, which the dispatch by rows does not send to the experts' "
                             f"owners; use train.expert_parallel=1")
        counts = self._counts(rows, args)
        splits = counts.reshape(size, per_rank).sum(dim=1).to(torch.int32)
        name = f"ep.{self.name}"
        (received,), received_splits = _alltoall((rows,), splits, self.group, (f"{name}.rows",))
        (theirs,), _ = _alltoall((counts,), torch.full((size,), per_rank, dtype=torch.int32), self.group,
                                 (f"{name}.counts",))
        theirs = theirs.reshape(size, per_rank)  # [rank, local expert]: the rows it sent of each
        starts = torch.cumsum(theirs.reshape(-1), 0) - theirs.reshape(-1)
        starts = starts.reshape(size, per_rank)
        order = torch.cat([torch.arange(int(starts[r, e]), int(starts[r, e] + theirs[r, e]))
                           for e in range(per_rank) for r in range(size)]).to(rows.device)
        local = received[order]
        if self.layout == EXPERT_MAJOR:
            computed = type(self.module).forward(self.module, local)
        else:
            computed = type(self.module).forward(self.module, local, theirs.sum(dim=0).tolist())
        if received.requires_grad and not computed.requires_grad:
            computed = computed + received.sum() * 0
        back = computed[torch.argsort(order)]  # in the order received: by rank, then expert
        (returned,), _ = _alltoall((back,), received_splits, self.group, (f"{name}.combine",))
        return returned


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

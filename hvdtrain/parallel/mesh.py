"""The device mesh: world = data x pipeline x tensor, and a Horovod process set for every group.

Tensor parallelism is innermost (neighbouring ranks, so one host's ranks: it all-reduces twice per
transformer block), then the pipeline stages, then data parallelism outermost:

    rank = (data * pipeline_size + stage) * tensor_size + tensor

The groups: each tensor-parallel group, each data-parallel group, each pipeline (all the stages of
one data and tensor coordinate), each pair of neighbouring stages, and each pipeline's first and last
stage (for weights the two share, such as a tied embedding). A group of one rank has no process set:
it has nothing to communicate. The process sets are the topology's (hvdtrain.parallel.topology, which
makes every set of the job once, in one order on every rank); a Mesh is a view of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import horovod.torch as hvd

from hvdtrain.common.errors import LayoutError

Ranks = Tuple[int, ...]


class Coordinates(NamedTuple):
    data: int
    stage: int
    tensor: int


@dataclass(frozen=True)
class MeshShape:
    """How many ranks along each axis: data x pipeline x tensor = the world size."""

    data: int
    pipeline: int
    tensor: int

    @classmethod
    def for_world(cls, world_size: int, tensor: int = 1, pipeline: int = 1) -> "MeshShape":
        """The shape with the data-parallel width that fills the world, or LayoutError (a ValueError) saying what divides."""
        for name, value in (("tensor_parallel", tensor), ("pipeline_parallel", pipeline)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"train.{name} must be a whole number >= 1, got {value!r}")
        model = tensor * pipeline
        if world_size % model:
            fits = [n for n in range(model, 4 * model + 1, model)]
            raise LayoutError(
                f"train.tensor_parallel={tensor} x train.pipeline_parallel={pipeline} = {model} ranks per model "
                f"replica does not divide the {world_size} workers: run {' or '.join(map(str, fits[:3]))} workers, "
                f"or choose tensor_parallel x pipeline_parallel dividing {world_size}")
        return cls(world_size // model, pipeline, tensor)

    @property
    def size(self) -> int:
        return self.data * self.pipeline * self.tensor

    def coordinates(self, rank: int) -> Coordinates:
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is outside a mesh of {self.size} ranks")
        tensor = rank % self.tensor
        stage = (rank // self.tensor) % self.pipeline
        return Coordinates(rank // (self.tensor * self.pipeline), stage, tensor)

    def rank_of(self, data: int, stage: int, tensor: int) -> int:
        return (data * self.pipeline + stage) * self.tensor + tensor

    # The groups, each a tuple of ranks in increasing order.
    def tensor_group(self, rank: int) -> Ranks:
        d, p, _ = self.coordinates(rank)
        return tuple(self.rank_of(d, p, t) for t in range(self.tensor))

    def data_group(self, rank: int) -> Ranks:
        _, p, t = self.coordinates(rank)
        return tuple(self.rank_of(d, p, t) for d in range(self.data))

    def pipeline_group(self, rank: int) -> Ranks:
        d, _, t = self.coordinates(rank)
        return tuple(self.rank_of(d, p, t) for p in range(self.pipeline))

    def stage_pair(self, rank: int, stage: int) -> Optional[Ranks]:
        """Stages ``stage`` and ``stage + 1`` of ``rank``'s pipeline (None past the last stage)."""
        if not 0 <= stage < self.pipeline - 1:
            return None
        d, _, t = self.coordinates(rank)
        return (self.rank_of(d, stage, t), self.rank_of(d, stage + 1, t))

    def ends(self, rank: int) -> Optional[Ranks]:
        """The first and last stage of ``rank``'s pipeline (None without a pipeline)."""
        if self.pipeline < 2:
            return None
        d, _, t = self.coordinates(rank)
        return (self.rank_of(d, 0, t), self.rank_of(d, self.pipeline - 1, t))

    def all_groups(self) -> Iterator[Ranks]:
        """Every group of every rank, each once, in one order that every rank computes alike."""
        seen = set()
        for rank in range(self.size):
            groups = [self.tensor_group(rank), self.data_group(rank), self.pipeline_group(rank),
                      self.ends(rank)] + [self.stage_pair(rank, s) for s in range(self.pipeline - 1)]
            for group in groups:
                if group is not None and len(group) > 1 and group not in seen:
                    seen.add(group)
                    yield group


class Group:
    """One group seen from a member: its ranks, this rank's index in it, and its process set
    (None for a group of one rank, which has nothing to communicate)."""

    def __init__(self, ranks: Ranks, rank: int, process_set: Optional[hvd.ProcessSet]) -> None:
        self.ranks = ranks
        self.index = ranks.index(rank)
        self.process_set = process_set

    @property
    def size(self) -> int:
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"Group(ranks={self.ranks}, index={self.index})"


class OwnedGroups:
    """Groups a strategy asks a topology for (the expert groups, hsdp's): the run's topology, extended
    with them (a collective: every rank alike), or for a strategy built without one (a unit test's) a
    topology of their own, which ``close`` closes."""

    _owner: Any = None

    @staticmethod
    def _asked(world: Any, topology: Any, view: str, **dimension: int) -> Any:
        from hvdtrain.parallel.topology import Topology  # it imports this module

        own = topology is None
        topology = (Topology(world) if own else topology).extend(**dimension)
        groups = getattr(topology, view)
        if own:
            groups._owner = topology
        return groups

    def close(self) -> None:
        """Close the topology these groups own, if any (a collective); a shared topology's owner closes it."""
        owner, self._owner = self._owner, None
        if owner:
            owner.close()


class Mesh:
    """This rank's place in the mesh and its groups' process sets (a view: a Topology holds the sets).
    ``build`` and ``close`` are collectives over the whole world: every rank calls them, with the same shape.

    Args:
        shape: the mesh's shape.
        rank: this rank.
        sets: ranks -> process set, for every group of the mesh (the topology's).
        held: the sets ``close`` releases (``build``'s own; a topology's mesh holds none).
    """

    def __init__(self, shape: MeshShape, rank: int, sets: Dict[Ranks, hvd.ProcessSet],
                 held: Tuple[Ranks, ...] = ()) -> None:
        self.shape, self.rank = shape, rank
        self.coordinates = shape.coordinates(rank)
        self._added = list(held)
        group = lambda ranks: None if ranks is None else Group(ranks, rank, sets.get(ranks))
        self.tensor = group(shape.tensor_group(rank))
        self.data = group(shape.data_group(rank))
        self.pipeline = group(shape.pipeline_group(rank))
        stage = self.coordinates.stage
        self.next_pair = group(shape.stage_pair(rank, stage))  # this stage and the next
        self.prev_pair = group(shape.stage_pair(rank, stage - 1))  # the previous stage and this one
        # Only the first and the last stage are members of their pipeline's ends.
        self.ends = group(shape.ends(rank)) if stage in (0, shape.pipeline - 1) else None

    @classmethod
    def build(cls, world_size: int, rank: int, tensor: int = 1, pipeline: int = 1) -> "Mesh":
        """The mesh of a world alone (a bench's, a test's): its shape, and a Horovod process set for each group of
        ranks through the topology's registry, shared with any live topology's (collective: every rank builds it).
        A training's mesh is its Topology's.

        Args:
            world_size: ranks in the world.
            rank: this rank.
            tensor: T, ranks per tensor-parallel group.
            pipeline: P, pipeline stages.
        """
        from hvdtrain.parallel.topology import acquire_sets

        shape = MeshShape.for_world(world_size, tensor, pipeline)
        sets, held = acquire_sets(shape.all_groups(), world_size)
        return cls(shape, rank, sets, tuple(held))

    @property
    def stage(self) -> int:
        return self.coordinates.stage

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.shape.pipeline - 1

    def close(self) -> None:
        """Release the sets ``build`` acquired, removing those no live topology holds (a collective: every rank,
        in the same order). A topology's mesh holds none: its topology closes them."""
        from hvdtrain.parallel.topology import release_sets

        held, self._added = self._added, []
        release_sets(held)


def describe_rank(shape: MeshShape, rank: int, hostname: str) -> str:
    d, p, t = shape.coordinates(rank)
    return f"rank {rank} on {hostname}: data {d}/{shape.data}, stage {p}/{shape.pipeline}, tensor {t}/{shape.tensor}"


def layout_lines(shape: MeshShape, hostnames: List[str]) -> List[str]:
    """One line per rank, for rank 0's start lines: the whole mesh, and which host holds what."""
    return [describe_rank(shape, rank, host) for rank, host in enumerate(hostnames)]

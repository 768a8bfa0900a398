"""Who this process is in the job: the world, every parallel dimension over it, and every Horovod
process set of their groups. One object owns them, so that a world change (Horovod elastic) is one
update, and so that every process set is made, shared and removed in one place: the mesh, the
sequence groups, the expert groups and hsdp's shard groups are views of it (their ranks, this rank's
index, their set), and no other code adds a process set.

The dimensions and their order on the ranks (``Dimensions``):

    tensor (T)     innermost: T neighbouring ranks (one host's; two all-reduces per block)
    pipeline (P)   then the stages: rank = (data * P + stage) * T + tensor
    data (D)       outermost: D = N / (T P) model replicas, the strategy's ranks
    sequence (S)   inside the data axis around the tensor groups: S consecutive data coordinates of
                   one tensor index (stride T); the data sees N / (S T) workers
    experts (E)    E consecutive data ranks (no mesh with it); the expert replicas: stride E
    shard (K)      hsdp: K consecutive ranks (dp_shard); the replicas: stride K (dp_replicate)

Which of them combine is hvdtrain.common.layout_rules' (checked once, when the dimensions are made).
Every rank computes the same groups in the same order (``Dimensions.all_groups``) and makes their
process sets in that order (hvd.add_process_set is a collective over the whole world); a set of the
same ranks is made once and shared (PROCESS_SETS counts its holders, so a topology built while
another lives, a test's or a strategy's own, shares it), a group of one rank has none, the whole
world's is Horovod's global set. ``close`` removes what this topology holds (a collective).
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import replace
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

import horovod.torch as hvd

from hvdtrain.common import layout_rules
from hvdtrain.common.errors import LayoutError
from hvdtrain.distributed import startup
from hvdtrain.distributed.logs import get_logger
from hvdtrain.distributed.world import World
from hvdtrain.parallel.mesh import Group, Mesh, MeshShape, OwnedGroups, Ranks
from hvdtrain.parallel.sequence.groups import SequenceGroup, check_divides
from hvdtrain.parallel.sequence.groups import group_ranks as sequence_group_ranks

Follower = Callable[["Topology"], None]
# Every group's name, in the order Dimensions.all_groups makes them.
GROUP_NAMES = ("tensor", "data", "pipeline", "ends", "stage pair", "sequence", "expert", "expert_replica",
               "shard", "replica")


# --- every process set of the job, by its ranks ------------------------------------------------------

class ProcessSets:
    """The process sets topologies made, and how many topologies hold each: Horovod refuses a second set
    of the same ranks, so a topology built while another lives shares its sets. Every rank acquires and
    releases in the same order, so the counts agree across ranks."""

    def __init__(self) -> None:
        self._sets: Dict[Ranks, list] = {}

    def acquire(self, ranks: Ranks, world_size: int) -> Optional[hvd.ProcessSet]:
        """The process set of ``ranks``: made (a collective over the world: every rank, in the same order)
        or shared; the whole world's is Horovod's global set. (A topology asks for no group of one rank.)"""
        if len(ranks) == world_size:  # Horovod refuses a second set of the whole world's ranks
            return hvd.global_process_set
        if ranks not in self._sets:
            self._sets[ranks] = [hvd.add_process_set(list(ranks)), 0]
        self._sets[ranks][1] += 1
        return self._sets[ranks][0]

    def release(self, ranks: Ranks) -> None:
        """One holder fewer of ``ranks``' set; removed with its last (a collective: every rank, in the same order)."""
        held = self._sets.get(ranks)
        if held is None:
            return
        held[1] -= 1
        if held[1] == 0:
            hvd.remove_process_set(self._sets.pop(ranks)[0])

    def held(self) -> Dict[Ranks, int]:
        """Ranks -> how many topologies hold its set (the live sets)."""
        return {ranks: count for ranks, (_, count) in self._sets.items()}


PROCESS_SETS = ProcessSets()


def acquire_sets(groups: Iterable[Ranks], world_size: int) -> Tuple[Dict[Ranks, Optional[hvd.ProcessSet]], List[Ranks]]:
    """The sets of ``groups`` in their order (each distinct ranks once), refused alike on every rank when
    Horovod started without dynamic process sets: (ranks -> set, the ranks held, to release)."""
    distinct = list(dict.fromkeys(groups))
    if any(1 < len(g) < world_size for g in distinct) and not startup.dynamic_process_sets_enabled():
        raise ValueError(startup.dynamic_process_sets_conflict())
    sets = {ranks: PROCESS_SETS.acquire(ranks, world_size) for ranks in distinct}
    return sets, [ranks for ranks in distinct if 1 < len(ranks) < world_size]


def release_sets(held: Iterable[Ranks]) -> None:
    for ranks in held:
        PROCESS_SETS.release(ranks)


# --- the dimensions and their groups (pure arithmetic) ----------------------------------------------

def _consecutive(rank: int, size: int) -> Ranks:
    start = rank - rank % size
    return tuple(range(start, start + size))


def _strided(world_size: int, rank: int, size: int) -> Ranks:
    return tuple(range(rank % size, world_size, size))


@dataclasses.dataclass(frozen=True)
class Dimensions:
    """How many ranks along each dimension, checked once (LayoutError, a ValueError, saying what divides or
    what does not combine, hvdtrain.common.layout_rules').

    Args:
        world_size: N, ranks in the world.
        tensor: T, ranks per tensor group.
        pipeline: P, pipeline stages.
        sequence: S, ranks per sequence group.
        experts: E, ranks per expert group.
        shard: K, ranks per hsdp shard group (0: not hsdp).
    """

    world_size: int
    tensor: int = 1
    pipeline: int = 1
    sequence: int = 1
    experts: int = 1
    shard: int = 0

    def __post_init__(self) -> None:
        if self.tensor * self.pipeline > 1:
            MeshShape.for_world(self.world_size, self.tensor, self.pipeline)  # whole numbers, dividing
        for name, value, low in (("sequence_parallel", self.sequence, 1), ("expert_parallel", self.experts, 1),
                                 ("hsdp_shard_size", self.shard, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise LayoutError(f"train.{name} must be a whole number >= {low}, got {value!r}")
        settings = {layout_rules.TENSOR: self.tensor, layout_rules.PIPELINE: self.pipeline,
                    layout_rules.SEQUENCE: self.sequence, layout_rules.EXPERT: self.experts}
        if self.shard:
            settings["strategy"] = "hsdp"
        why = layout_rules.check(settings, prefix="train.")
        if why is not None:
            raise LayoutError(why)
        if self.sequence > 1:
            check_divides(self.world_size, self.sequence, self.tensor)
        if self.experts > 1 and self.world_size % self.experts:
            fits = [n for n in range(self.experts, 4 * self.experts + 1, self.experts)]
            raise LayoutError(f"train.expert_parallel={self.experts} does not divide the {self.world_size} workers: "
                              f"each expert group is {self.experts} ranks of the data-parallel world; run "
                              f"{' or '.join(map(str, fits[:3]))} workers, or choose an expert_parallel dividing "
                              f"{self.world_size}")
        if self.shard and self.world_size % self.shard:
            raise LayoutError(f"train.strategy=hsdp with {self.shard} ranks per shard group does not divide the "
                              f"{self.world_size} workers: set train.hsdp_shard_size to a divisor of {self.world_size}")

    @property
    def mesh(self) -> Optional[MeshShape]:
        """The data x pipeline x tensor mesh, or None without model parallelism."""
        if self.tensor * self.pipeline == 1:
            return None
        return MeshShape.for_world(self.world_size, self.tensor, self.pipeline)

    @property
    def data(self) -> int:
        """D, model replicas: the strategy's data-parallel ranks per (stage, tensor index)."""
        return self.world_size // (self.tensor * self.pipeline)

    def sizes(self) -> Dict[str, int]:
        """Every dimension's size: dp_replicate x dp_shard = D (hsdp's replicas and shards), tp, pp, sp, ep."""
        shard = self.shard or 1
        return {"dp_replicate": self.data // shard, "dp_shard": shard, "tp": self.tensor, "pp": self.pipeline,
                "sp": self.sequence, "ep": self.experts}

    def groups_of(self, rank: int) -> Dict[str, Ranks]:
        """Every group ``rank`` belongs to, by name (the dimensions of size 1 have none; "next pair",
        "previous pair" and "ends" only where the pipeline has them for this rank)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size} ranks")
        found: Dict[str, Ranks] = {}
        mesh = self.mesh
        if mesh is not None:
            found.update(tensor=mesh.tensor_group(rank), data=mesh.data_group(rank),
                         pipeline=mesh.pipeline_group(rank))
            stage = mesh.coordinates(rank).stage
            for name, pair in (("next pair", mesh.stage_pair(rank, stage)),
                               ("previous pair", mesh.stage_pair(rank, stage - 1))):
                if pair is not None:
                    found[name] = pair
            if mesh.ends(rank) is not None and stage in (0, mesh.pipeline - 1):
                found["ends"] = mesh.ends(rank)
        if self.sequence > 1:
            found["sequence"] = next(g for g in sequence_group_ranks(self.world_size, self.sequence, self.tensor)
                                     if rank in g)
        if self.experts > 1:
            found["expert"] = _consecutive(rank, self.experts)
            found["expert_replica"] = _strided(self.world_size, rank, self.experts)
        if self.shard:
            found["shard"] = _consecutive(rank, self.shard)
            found["replica"] = _strided(self.world_size, rank, self.shard)
        return found

    def coordinates(self, rank: int) -> Dict[str, Tuple[int, int]]:
        """``rank``'s (index, size) along every dimension: data, stage, tensor, sequence, expert, shard, replica."""
        groups = self.groups_of(rank)
        found: Dict[str, Tuple[int, int]] = {}
        mesh = self.mesh
        d, p, t = mesh.coordinates(rank) if mesh is not None else (rank, 0, 0)
        found["data"] = (d, self.data)
        found["stage"] = (p, self.pipeline)
        found["tensor"] = (t, self.tensor)
        for name, dimension in (("sequence", "sequence"), ("expert", "expert"), ("shard", "shard"),
                                ("expert_replica", "expert replica"), ("replica", "replica")):
            if name in groups:
                found[dimension] = (groups[name].index(rank), len(groups[name]))
        return found

    def all_groups(self) -> List[Tuple[str, Ranks]]:
        """(name, ranks) of every group of more than one rank, each distinct ranks once (under the first
        name that has it), in one order that every rank computes alike: the mesh's (tensor, data,
        pipeline, ends, stage pairs, rank by rank), the sequence groups, the expert and expert-replica
        groups, hsdp's shard and replica groups."""
        named: List[Tuple[str, Optional[Ranks]]] = []
        mesh = self.mesh
        if mesh is not None:
            for rank in range(self.world_size):
                named += [("tensor", mesh.tensor_group(rank)), ("data", mesh.data_group(rank)),
                          ("pipeline", mesh.pipeline_group(rank)), ("ends", mesh.ends(rank))]
                named += [("stage pair", mesh.stage_pair(rank, s)) for s in range(mesh.pipeline - 1)]
        if self.sequence > 1:
            named += [("sequence", g) for g in sequence_group_ranks(self.world_size, self.sequence, self.tensor)]
        for name, size in (("expert", self.experts), ("shard", self.shard)):
            if size > 1:
                replica = "expert_replica" if name == "expert" else "replica"
                for rank in range(self.world_size):
                    named += [(name, _consecutive(rank, size)), (replica, _strided(self.world_size, rank, size))]
        seen, found = set(), []
        for name, ranks in named:
            if ranks is not None and len(ranks) > 1 and ranks not in seen:
                seen.add(ranks)
                found.append((name, ranks))
        return found

    def describe(self, rank: int, hostname: str = "") -> str:
        """One line: ``rank`` and its coordinate along every dimension of more than one rank."""
        where = f" on {hostname}" if hostname else ""
        parts = [f"{name} {index}/{size}" for name, (index, size) in self.coordinates(rank).items()
                 if size > 1 or name == "data"]
        return f"rank {rank}{where}: " + ", ".join(parts)


# --- hsdp's groups (hvdtrain.strategies.fsdp.hybrid) ---------------------------------------------

class HybridGroups(OwnedGroups):
    """This rank's shard group and replica group with their Horovod process sets (None for a group of
    one rank): a view of a topology's groups (hvdtrain.parallel.topology makes and removes every set).

    Args:
        size: K, ranks per shard group.
        shard: this rank's shard group (fsdp's gathers and reduce-scatters).
        replica: the ranks holding the same slices (the once-per-step all-reduce).
        owner: the topology ``close`` closes (one made for these groups alone); None: its owner closes it.
    """

    def __init__(self, size: int, shard: Group, replica: Group, owner: Any = None) -> None:
        self.size, self.shard, self.replica, self._owner = size, shard, replica, owner

    @classmethod
    def of(cls, world: World, size: int, topology: Any = None) -> "HybridGroups":
        """This rank's groups of K = ``size`` (dividing the world: hybrid.refusal) from ``topology``, extended
        with them if it has none (a collective: every rank alike), or from a topology of their own when given
        none, which ``close`` closes.

        Args:
            world: this rank's World.
            size: K, ranks per shard group.
            topology: the run's Topology, or None.
        """
        return cls._asked(world, topology, "hybrid", shard=size)


# --- the topology ------------------------------------------------------------------------------------

class Topology:
    """The world, its dimensions and every group's process set; the views: ``mesh`` (tensor x pipeline,
    None without), ``sequence`` (this rank's sequence group, None without), ``experts`` (its expert and
    expert-replica groups) and ``hybrid`` (hsdp's shard and replica groups). ``build``, ``extend`` and
    ``close`` are collectives over the whole world: every rank calls them, alike.

    Args:
        world: this rank's World.
        dimensions: the dimensions (default: data parallelism alone, no process set).
    """

    def __init__(self, world: World, dimensions: Optional[Dimensions] = None) -> None:
        self.world = world
        self.dimensions = dimensions or Dimensions(world.size)
        self._sets: Dict[Ranks, Optional[hvd.ProcessSet]] = {}
        self._held: List[Ranks] = []
        self._followers: List[Follower] = []
        if dimensions is not None:
            self._acquire(dimensions)
        self._views()

    @classmethod
    def build(cls, world: World, tensor_parallel: int = 1, pipeline_parallel: int = 1, sequence_parallel: int = 1,
              expert_parallel: int = 1, hsdp_shard_size: int = 0) -> "Topology":
        """The dimensions checked once, every group's process set made (refused on every rank alike when the
        dimensions do not divide the world or do not combine); without model, sequence, expert or hsdp
        parallelism there are none.

        Args:
            world: this rank's World.
            tensor_parallel: T, ranks per tensor group.
            pipeline_parallel: P, pipeline stages.
            sequence_parallel: S, ranks per sequence group.
            expert_parallel: E, ranks per expert group.
            hsdp_shard_size: K, ranks per hsdp shard group (0: not hsdp; a strategy resolves a host's size first).
        """
        return cls(world, Dimensions(world.size, tensor_parallel, pipeline_parallel, sequence_parallel,
                                     expert_parallel, hsdp_shard_size))

    def extend(self, **sizes: int) -> "Topology":
        """This topology with more dimensions (``experts=E``, ``shard=K``: a strategy's groups, asked for
        once it has refused what it refuses), their sets made after the ones held; a dimension already
        there at the same size is kept as it is. A collective: every rank, alike. Returns itself."""
        changed = {name: size for name, size in sizes.items() if getattr(self.dimensions, name) != size}
        for name in changed:
            if getattr(self.dimensions, name) not in (0, 1):
                raise ValueError(f"the topology's {name} is {getattr(self.dimensions, name)} already, asked for "
                                 f"{sizes[name]}")
        if changed:
            dimensions = replace(self.dimensions, **changed)
            self._acquire(dimensions)
            self.dimensions = dimensions
            self._views()
        return self

    def _acquire(self, dimensions: Dimensions) -> None:
        wanted = [ranks for _, ranks in dimensions.all_groups()]
        new = [ranks for ranks in wanted if ranks not in self._sets]
        sets, held = acquire_sets(new, self.world.size)
        self._sets.update(sets)
        self._held += held

    def _set(self, ranks: Ranks) -> Optional[hvd.ProcessSet]:
        if len(ranks) == self.world.size and len(ranks) > 1:
            return hvd.global_process_set
        return self._sets.get(ranks)

    def _views(self) -> None:
        dims, rank = self.dimensions, self.world.rank
        shape = dims.mesh
        self.mesh: Optional[Mesh] = Mesh(shape, rank, self._sets) if shape is not None else None
        groups = dims.groups_of(rank) if dims.world_size == self.world.size else {}
        self.sequence: Optional[SequenceGroup] = None
        if "sequence" in groups:
            ranks = groups["sequence"]
            self.sequence = SequenceGroup(ranks, rank, self._set(ranks), dims.world_size, dims.tensor)
        self.experts = self.hybrid = None
        if "expert" in groups:
            from hvdtrain.parallel.experts import ExpertGroups

            self.experts = ExpertGroups(dims.experts, self.group("expert"), self.group("expert_replica"))
        if "shard" in groups:
            self.hybrid = HybridGroups(dims.shard, self.group("shard"), self.group("replica"))

    def group(self, name: str) -> Optional[Group]:
        """This rank's group ``name`` (GROUP_NAMES; "next pair" and "previous pair" for the stage pairs)
        with its process set, or None when this rank has none."""
        ranks = self.dimensions.groups_of(self.world.rank).get(name)
        return None if ranks is None else Group(ranks, self.world.rank, self._set(ranks))

    @property
    def held(self) -> List[Ranks]:
        """The process sets this topology holds (released by close)."""
        return list(self._held)

    @property
    def log(self) -> logging.Logger:
        """The logger of this process's current rank (rank 0 speaks; the others warn)."""
        return get_logger(self.world)

    @property
    def is_root(self) -> bool:
        return self.world.is_root

    @property
    def data_world(self) -> World:
        """What the data sees: one worker per model replica (the data-parallel group's width), one per
        sequence group."""
        if self.sequence is not None:
            return replace(self.world, rank=self.sequence.data_index, size=self.sequence.data_workers)
        if self.mesh is None:
            return self.world
        return replace(self.world, rank=self.mesh.coordinates.data, size=self.mesh.shape.data)

    @property
    def rng_rank(self) -> int:
        """Whose random stream this rank draws: a tensor group computes replicated activations alike,
        so its dropout masks must agree, and its ranks share the group's first rank's stream."""
        return self.mesh.tensor.ranks[0] if self.mesh is not None else self.world.rank

    @property
    def mesh_shape(self) -> Tuple[int, int, int]:
        """(data, pipeline, tensor): whose RNG state is whose in a checkpoint."""
        if self.mesh is None:
            return (self.world.size, 1, 1)
        shape = self.mesh.shape
        return (shape.data, shape.pipeline, shape.tensor)

    def follow(self, follower: Follower) -> None:
        """Call ``follower(self)`` after every world change (a part that keeps per-rank resources)."""
        self._followers.append(follower)

    def reform(self) -> int:
        """Horovod elastic formed a new world: take its ranks, tell the followers; returns the old size.
        A mesh and sequence groups are refused here; expert and hsdp groups by their strategies (which
        refuse elastic launches, hvdtrain.common.capabilities)."""
        if self.mesh is not None or self.sequence is not None:
            raise RuntimeError("a model-parallel mesh or sequence groups are fixed at start: Horovod elastic cannot "
                               "re-form them")
        previous = self.world.size
        self.world = startup.reformed(self.world)
        for follower in self._followers:
            follower(self)
        return previous

    def close(self) -> None:
        """Remove every process set this topology holds that no other live topology holds (a collective:
        every rank calls it, in the same order). Closing twice does nothing more.

        Horovod negotiates every live process set on every cycle, so sets left behind slow every
        later collective of a process that goes on (a sweep of Trainers, a test suite)."""
        held, self._held = self._held, []
        release_sets(held)

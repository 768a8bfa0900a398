"""Who this process is in the job: the world, the model-parallel mesh over it, and the views that
follow from them. One object owns them, so that a world change (Horovod elastic) is one update:
every part of the Trainer reads the world from here when it acts, never from a copy of its own.
"""
from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable, List, Optional, Tuple

from hvdtrain.distributed import startup
from hvdtrain.distributed.world import World
from hvdtrain.distributed.logs import get_logger
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.sequence.groups import SequenceGroup

Follower = Callable[["Topology"], None]


class Topology:
    """The world and, when one model replica spans several ranks, the mesh over it; under sequence
    parallelism, this rank's sequence group (its ranks share a batch, each holds part of every sequence)."""

    def __init__(self, world: World, mesh: Optional[Mesh] = None, sequence: Optional[SequenceGroup] = None) -> None:
        self.world = world
        self.mesh = mesh
        self.sequence = sequence
        self._followers: List[Follower] = []

    @classmethod
    def build(cls, world: World, tensor_parallel: int = 1, pipeline_parallel: int = 1,
              sequence_parallel: int = 1) -> "Topology":
        """The mesh and the sequence groups are collectives (every rank makes the same process sets),
        refused on every rank alike when they do not divide the world; without model or sequence
        parallelism there are none.

        Args:
            world: this rank's World.
            tensor_parallel: T, ranks per tensor group.
            pipeline_parallel: P, pipeline stages.
            sequence_parallel: S, ranks per sequence group.
        """
        mesh = sequence = None
        if tensor_parallel * pipeline_parallel > 1:
            mesh = Mesh.build(world.size, world.rank, tensor_parallel, pipeline_parallel)
        if sequence_parallel > 1:
            sequence = SequenceGroup.build(world.size, world.rank, sequence_parallel, tensor_parallel)
        return cls(world, mesh, sequence)

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
        """Horovod elastic formed a new world: take its ranks, tell the followers; returns the old size."""
        if self.mesh is not None or self.sequence is not None:
            raise RuntimeError("a model-parallel mesh or sequence groups are fixed at start: Horovod elastic cannot "
                               "re-form them")
        previous = self.world.size
        self.world = startup.reformed(self.world)
        for follower in self._followers:
            follower(self)
        return previous

    def close(self) -> None:
        """Remove the mesh's Horovod process sets (a collective: every rank calls it).

        Horovod negotiates every live process set on every cycle, so sets left behind slow every
        later collective of a process that goes on (a sweep of Trainers, a test suite)."""
        if self.mesh is not None:
            self.mesh.close()
        if self.sequence is not None:
            self.sequence.close()

"""Hybrid sharded data parallelism (train.strategy=hsdp): fsdp within each shard group, ddp across them.

The N ranks form N/K shard groups of K consecutive ranks: by default K is the ranks of one host
(Horovod's local size; ranks fill hosts in order, as mpirun and horovodrun place them), and
train.hsdp_shard_size picks another K (a smaller group than a host, or a simulated host split on one
machine). Within its shard group a rank is fsdp's: it keeps slice k of every unit's flat buffers
(1/K of the parameters, gradients and optimizer state: 16 Psi / K bytes for fp32 Adam), and the
all-gathers and reduce-scatters of each unit run over the shard group's Horovod process set, inside
the host. The ranks holding the same slice, one per shard group (stride K), form a replica group:
once per step, after the reduce-scatters (averaged over the shard group), the slices' gradients are
averaged over the replica group by one grouped all-reduce (fused by Horovod). Every group has K
ranks, so the mean of the groups' means is the world's mean: the gradient one process computes from
the whole batch, and each replica steps its slice alike. What crosses hosts per step is that
all-reduce of Psi / K elements per rank (a ring moves 2 (R - 1) / R of it, R = N / K), where fsdp over
every rank sends its gathers and reduce-scatters of the whole model across hosts.

A full checkpoint is fsdp's full format (gathered within the shard group; the optimizer state
assembled alike on every rank, rank 0 writes). A sharded one gathers nothing: the ranks of the first
shard group (0..K-1) each write their slices of the units' flat buffers as fsdp over K ranks holds
them, recorded as the element ranges of the parameters each slice cuts with the same ranges of the
optimizer's per-element state, rank 0 the tensors outside the buffers; the other groups' ranks hold
copies of those slices and write their RNG states only (hvdtrain.strategies.expert_shards.fsdp_shard_part).
The files have a mesh's layout (capabilities' loads: every part): each rank reads the ranges of its
slices from the files that hold them, at this K or another, and every strategy, consolidation and
export read it through the checkpoint's sources. Either format resumes under hsdp at any K and under
every other strategy. Horovod elastic is refused: the process sets are fixed at start.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

import horovod.torch as hvd

from hvdtrain.common.capabilities import ELASTIC
from hvdtrain.distributed.world import World
from hvdtrain.parallel.mesh import Ranks
from hvdtrain.parallel.topology import HybridGroups
from hvdtrain.strategies import clipping, expert_shards
from hvdtrain.strategies.deferred_init import DeferredInit
from hvdtrain.strategies.fsdp.communication import UnitCommunication
from hvdtrain.strategies.fsdp.strategy import FSDPStrategy


def shard_group_size(setting: int, world: World) -> int:
    """K, ranks per shard group: train.hsdp_shard_size, or 0 for the ranks of one host."""
    return setting if setting else world.local_size


def refusal(setting: int, world_size: int, local_size: int, homogeneous: bool) -> Optional[str]:
    """Why hsdp cannot run at this world, or None: decided alike on every rank before any collective.

    Args:
        setting: train.hsdp_shard_size (0: the ranks of one host).
        world_size: N, ranks in the world.
        local_size: ranks on this host.
        homogeneous: every host runs the same number of ranks.
    """
    if isinstance(setting, bool) or not isinstance(setting, int) or setting < 0:
        return f"train.hsdp_shard_size must be a whole number >= 0 (0: the ranks of one host), got {setting!r}"
    if not setting and not homogeneous:
        return ("train.strategy=hsdp shards over each host's ranks, and the hosts run different numbers of ranks: "
                "run the same number on every host, or set train.hsdp_shard_size to a K dividing the world")
    size = setting or local_size
    if size == 1:
        where = "train.hsdp_shard_size=1" if setting else "each host runs one rank"
        return (f"train.strategy=hsdp with one rank per shard group ({where}) holds the whole model on every rank, "
                f"as ddp does: use train.strategy=ddp, or set train.hsdp_shard_size > 1")
    if world_size % size:
        fits = [n for n in range(size, 4 * size + 1, size)]
        return (f"train.strategy=hsdp with {size} ranks per shard group "
                f"({'train.hsdp_shard_size' if setting else 'the ranks of one host'}) does not divide the "
                f"{world_size} workers: run {' or '.join(map(str, fits[:3]))} workers, or set "
                f"train.hsdp_shard_size to a divisor of {world_size}")
    return None


def hosts_refusal(hostnames: List[str], size: int) -> Optional[str]:
    """Why the host-sized shard groups (train.hsdp_shard_size=0) would not be hosts, or None: K consecutive
    ranks must share a host, as launchers that fill hosts in order place them.

    Args:
        hostnames: every rank's host, by rank.
        size: K, ranks per shard group (a host's).
    """
    for start in range(0, len(hostnames), size):
        hosts = sorted(set(hostnames[start:start + size]))
        if len(hosts) > 1:
            return (f"train.strategy=hsdp shards over each host's ranks, but ranks {start}..{start + size - 1} run on "
                    f"{', '.join(hosts)}: place ranks host by host (mpirun --map-by slot, horovodrun's default), "
                    f"or set train.hsdp_shard_size")
    return None


def shard_group_ranks(world_size: int, rank: int, size: int) -> Ranks:
    """The K consecutive ranks whose slices make every unit whole, ``rank`` among them."""
    start = rank - rank % size
    return tuple(range(start, start + size))


def replica_group_ranks(world_size: int, rank: int, size: int) -> Ranks:
    """The ranks holding the same slices as ``rank``: one per shard group (stride K)."""
    return tuple(range(rank % size, world_size, size))


class HSDPStrategy(FSDPStrategy):
    """fsdp over each shard group of ``shard_size`` ranks, its slices' gradients averaged across the groups.

    Args:
        model: the model; its parameters are sharded over the shard group.
        optimizer: the user's optimizer over them.
        world: this rank's World.
        accumulation: micro-batches per optimizer step.
        fp16_allreduce: compress the reduce-scatters' gradients to fp16 (the all-reduce across groups stays in
            the parameters' dtype).
        shard_size: K, ranks per shard group; 0: the ranks of one host.
        deferred: the model was built on the meta device (fsdp's initialization by unit).
        overlap: what runs ahead of the compute, as fsdp's (train.fsdp_overlap).
        topology: the run's Topology, which holds the shard and replica groups' process sets (None: one of the
            strategy's own, closed by close_groups).
    """

    name = "hsdp"

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                 accumulation: int, fp16_allreduce: bool, shard_size: int = 0,
                 deferred: Optional[DeferredInit] = None, overlap: str = "auto", topology: Any = None) -> None:
        self.check_optimizer(optimizer)  # local, before any collective: the same verdict on every rank
        from hvdtrain.distributed import collectives

        why = refusal(shard_size, world.size, world.local_size, shard_size != 0 or collectives.homogeneous())
        if why is None and not shard_size:  # every rank judges the same gathered list: no rank waits alone
            why = hosts_refusal(collectives.allgather_object(world.hostname, name="hsdp.hosts"), world.local_size)
        if why is not None:
            raise ValueError(why)
        self.groups = HybridGroups.of(world, shard_group_size(shard_size, world), topology)
        self._replicas_owed = False  # a micro-batch closed since the slices were last averaged across groups
        super().__init__(model, optimizer, world, accumulation, fp16_allreduce, overlap=overlap, deferred=deferred)

    @classmethod
    def from_config(cls, config: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer, world: World,
                    **context: Any) -> "HSDPStrategy":
        """Built from the settings: train.hsdp_shard_size besides fsdp's.

        Args:
            config: the run's settings (TrainConfig).
            model: the model.
            optimizer: its optimizer.
            world: this rank's World.
            context: what set-up knows besides: deferred initialization, if any; the topology, whose shard and
                replica groups these are.
        """
        return cls(model, optimizer, world, config.accumulation, config.fp16_allreduce,
                   shard_size=config.hsdp_shard_size, deferred=context.get("deferred"), overlap=config.fsdp_overlap,
                   topology=context.get("topology"))

    @property
    def label(self) -> str:
        return f"hsdp {self.groups.size} x {self.groups.replica.size}"

    # fsdp's units, cut over the shard group and exchanged within it.

    def _shard_place(self, world: World) -> Tuple[int, int]:
        return self.groups.shard.index, self.groups.size

    def _communication(self) -> UnitCommunication:
        return UnitCommunication(self.buckets, self.groups.shard.process_set, self.groups.shard.ranks,
                                 reductions_behind=self._reductions_behind)

    # The slices' gradients: averaged over the replica group once per step.

    def _close_micro_batch(self) -> None:
        super()._close_micro_batch()
        self._replicas_owed = True  # as fsdp's reduce-scatters: once per micro-batch on every rank

    def synchronize(self) -> None:
        if self._open:
            self._close_micro_batch()
        super().synchronize()  # every reduce-scatter finished: the shard gradients hold the group's mean
        if self._replicas_owed:
            self._average_across_groups()

    def _average_across_groups(self) -> None:
        self._replicas_owed = False
        gradients = [bucket.shard_grad for bucket in self.buckets]
        if self.groups.replica.process_set is None or not gradients:
            return  # one shard group: fsdp's mean is the world's
        hvd.synchronize(hvd.grouped_allreduce_async_(gradients, name=f"hsdp.grad.{len(gradients)}", op=hvd.Average,
                                                     process_set=self.groups.replica.process_set))

    def clip_grad_norm_(self, max_norm: float) -> float:
        # Every element counted once over the world: each slice by its first replica group's rank
        # (the replicas hold it alike after synchronize), clipped on every rank.
        shards = self.owned_gradients()
        counted = shards if self.groups.replica.index == 0 else []
        return clipping.clip_sharded(shards, max_norm, name="hsdp.grad_norm", counted=counted)

    # A sharded checkpoint: the first shard group's slices, each element once, in a mesh's layout.

    def shard_state_dict(self) -> Dict[str, Any]:
        """This rank's part of a sharded checkpoint: its slices of the units' buffers (element ranges of
        the parameters they cut, the optimizer's state alike) if it is in the first shard group, whose
        slices the other groups hold copies of; the tensors outside the buffers on rank 0. Local."""
        return expert_shards.fsdp_shard_part(self.model, self.buckets, self.optimizer,
                                             self._user_optimizer.param_groups, self.world.rank, self.world.size,
                                             1, writes_slices=self.groups.replica.index == 0)

    def load_part(self, part: Any) -> None:
        if "full" in part:
            self.load_state_dict(part["full"])
        else:  # this rank's slices, read by read_part from the files that hold them (every part)
            super().load_shard_state_dict(part)

    def check_shard_state_dict(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError(self._read_from_every_file())

    def load_shard_state_dict(self, state: Dict[str, Any]) -> None:
        raise NotImplementedError(self._read_from_every_file())

    def _read_from_every_file(self) -> str:
        return ("hsdp reads a sharded checkpoint from every rank's file (its capabilities' loads: every part), "
                "through load_from, never one rank's file alone: ranks outside the first shard group wrote no slices")

    # What hsdp does not do.

    def follow_world(self, world: World) -> None:
        raise RuntimeError(f"hsdp cannot follow a new world: {self.capabilities.refuses[ELASTIC]}; launch without "
                           f"--min-np/--max-np")

    def close_groups(self) -> None:
        """Remove the shard and replica groups' process sets if this strategy's own topology holds them (a
        collective: every rank calls it); the run's topology closes its own."""
        self.groups.close()

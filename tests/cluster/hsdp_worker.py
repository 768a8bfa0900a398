"""One rank of test_cluster.py's hsdp job: 4 ranks on hostA and hostB (mpirun, 2 per host).

    mpirun -np 4 --hostfile HOSTFILE python -m tests.cluster.hsdp_worker OUT.json

hsdp with its shard groups taken from the hosts (train.hsdp_shard_size=0), then fsdp over all 4 ranks,
on the same float64 model and batches; each runs one warm-up step (Horovod's first negotiation, the
buffers' first allocation), then MEASURED_STEPS steps between two barriers, around which rank 0 reads
hostA's eth0 counters: launch and set-up traffic stay outside the window. hostA's eth0 is one end of
the veth pair joining the hosts, so its tx + rx is every byte crossing between them (ranks on one host
talk over shared memory or that host's loopback). Rank 0 also takes the same steps as one process from
hsdp's initial weights, and writes everything (collected from every rank before) as JSON to OUT.json.
"""
import json
import sys
from pathlib import Path

import torch

from hvdtrain.distributed import collectives, startup
from hvdtrain.distributed.waiting import wait_without_spinning
from hvdtrain.strategies.fsdp.hybrid import HSDPStrategy
from hvdtrain.strategies.fsdp.strategy import FSDPStrategy
from tests.mpi.helpers import synthetic_classification
from tests.mpi.test_fsdp import FEATURES, CLASSES, Blocks, model_difference, reference_from
from tests.mpi.test_hsdp import ACCUMULATION, hsdp_steps, make_optimizer, reference_steps
from tests.mpi.test_zero import MICRO_BATCH

MEASURED_STEPS = 3
# Blocks of 2 x 128 x 1024 weights: 99.7% of the parameters are in the three units, the root part (embedding,
# norm, head) small, so that per step the model's bytes (6.3 MB) dwarf Horovod's and Open MPI's control messages.
WIDTH, HIDDEN = 128, 1024
INTERFACE = "eth0"


def interface_bytes(name: str = INTERFACE) -> int:
    """tx + rx bytes of this host's ``name``. /proc/net/dev lists the reader's network namespace (the
    host's); /sys/class/net would list the namespace that mounted /sys, the machine's."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        device, _, counters = line.partition(":")
        if device.strip() == name:
            fields = counters.split()
            return int(fields[0]) + int(fields[8])  # rx_bytes, tx_bytes
    raise RuntimeError(f"no interface {name} in /proc/net/dev on this host: run on the test cluster's hosts")


def unit_bytes(strategy) -> dict:
    """Padded float64 bytes of the root unit's buffers and of the other units' (gathered twice per micro-batch).
    Padded for hsdp's K = 2; fsdp's K = 4 pads each buffer by under 4 elements more, nothing at this size."""
    root = sum(bucket.padded_numel for bucket in strategy.root.buckets) * 8
    return {"root": root, "units": sum(bucket.padded_numel for bucket in strategy.buckets) * 8 - root}


def measured_run(strategy, data, world):
    """One warm-up step, then MEASURED_STEPS steps between barriers: (bytes crossing hosts, final state)."""
    hsdp_steps(strategy, data, world, 1)
    collectives.barrier()
    before = interface_bytes() if world.rank == 0 else 0
    hsdp_steps(strategy, data, world, MEASURED_STEPS, first=1)
    collectives.barrier()
    crossed = interface_bytes() - before if world.rank == 0 else 0
    return crossed, strategy.state_dict()


def main(out: str) -> None:
    world = startup.init(seed=1234, threads=1, dynamic_process_sets=True)
    wait_without_spinning()  # 4 ranks share the machine's 2 cores
    data = synthetic_classification(samples=192, features=FEATURES, classes=CLASSES)
    rows = MICRO_BATCH * ACCUMULATION * world.size
    report = {"world": world.size, "steps": MEASURED_STEPS, "micro_batches": ACCUMULATION}

    model = Blocks(seed=100 + world.rank, width=WIDTH, hidden=HIDDEN)  # differs per rank: set-up must fix that
    hsdp = HSDPStrategy(model, make_optimizer(model), world, ACCUMULATION, False)
    hsdp.broadcast_from_root()
    initial = hsdp.state_dict()["model"]
    report["label"] = hsdp.label
    report["shard_group_hosts"] = collectives.allgather_object(
        sorted(set(collectives.allgather_object(world.hostname, name="hsdp.cluster.hosts")[r]
                   for r in hsdp.groups.shard.ranks)), name="hsdp.cluster.groups")
    report["bytes"] = unit_bytes(hsdp)
    report["hsdp_crossed"], state = measured_run(hsdp, data, world)
    hsdp.close()
    hsdp.close_groups()

    model = Blocks(seed=100, width=WIDTH, hidden=HIDDEN)
    fsdp = FSDPStrategy(model, make_optimizer(model), world, ACCUMULATION, False)
    fsdp.broadcast_from_root()
    report["fsdp_crossed"], _ = measured_run(fsdp, data, world)
    fsdp.close()

    if world.rank == 0:  # one process, the whole batch of every step, from hsdp's initial weights
        reference, optimizer = reference_from(initial, make_optimizer,
                                              make_model=lambda: Blocks(seed=0, width=WIDTH, hidden=HIDDEN))
        reference_steps(reference, optimizer, data, 1 + MEASURED_STEPS, rows)
        difference = model_difference(state["model"], reference.state_dict())
        moved = max((state["model"][k] - initial[k]).abs().max().item() for k in initial)
    else:
        difference = moved = 0.0
    # Each rank's gathered model equals rank 0's: the difference above holds on every rank.
    mine = torch.cat([v.reshape(-1) for v in state["model"].values()])
    rows_everywhere = collectives.allgather_rows(mine, name="hsdp.cluster.models")
    report["ranks_agree"] = bool(torch.equal(rows_everywhere, rows_everywhere[:1].expand_as(rows_everywhere)))
    report["max_difference"], report["max_moved"] = difference, moved
    if world.rank == 0:
        Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])

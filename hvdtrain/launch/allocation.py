"""The hosts of the SLURM allocation this shell runs in, for launchers that want a host list.

horovodrun knows nothing of SLURM: inside an sbatch script, ``-H $(hvdtrain hosts)`` gives it
``node01:4,node02:4`` from SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE.
"""
from __future__ import annotations

from typing import List, Mapping

from hvdtrain.distributed.environments.nodelist import expand_nodelist
from hvdtrain.distributed.environments.slurm import expand_tasks_per_node
from hvdtrain.launch.hostfile import Host, HostfileError, check_hostname


def allocation_hosts(env: Mapping[str, str]) -> List[Host]:
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    tasks = env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not tasks:
        raise HostfileError(
            "not inside a SLURM allocation (SLURM_JOB_NODELIST and SLURM_TASKS_PER_NODE are unset): "
            "run this in an sbatch script or salloc shell, or give the hosts with -H/--hostfile"
        )
    names = expand_nodelist(nodelist)
    counts = expand_tasks_per_node(tasks)
    if len(names) != len(counts):
        raise HostfileError(
            f"SLURM_JOB_NODELIST={nodelist!r} names {len(names)} nodes but "
            f"SLURM_TASKS_PER_NODE={tasks!r} covers {len(counts)}"
        )
    return [Host(check_hostname(name, "SLURM_JOB_NODELIST"), count) for name, count in zip(names, counts)]

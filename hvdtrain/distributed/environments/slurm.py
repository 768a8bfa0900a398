"""SLURM's srun: ranks from SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID/SLURM_NODEID."""
from __future__ import annotations

import re
from typing import List, Optional

from hvdtrain.distributed.environments.base import ClusterEnvironment, LauncherEnvironmentError
from hvdtrain.distributed.environments.nodelist import expand_nodelist

_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(value: str) -> List[int]:
    """SLURM's ``2(x3),1`` form: tasks on each node, in node order -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for item in value.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if not match:
            raise LauncherEnvironmentError(
                f"SLURM tasks-per-node value {value!r} is malformed at {item!r}: expected N or N(xM)"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


class SlurmEnvironment(ClusterEnvironment):
    """A task started by srun (a job step), not the batch script itself.

    The batch shell also has SLURM_PROCID, so a step id is required: a plain ``python train.py``
    in an sbatch script is one process, not rank 0 of SLURM_NTASKS. mpirun inside an allocation
    is detected earlier, as Open MPI.
    """

    name = "SLURM srun"
    hint = ("srun started each task as its own 1-rank MPI world: use `srun --mpi=pmix` "
            "(`srun --mpi=list` shows what the site supports), or launch with mpirun inside the "
            "allocation; and ask for tasks with --ntasks-per-node, so that every node runs its share")

    # The step's own count first: `srun -n 2` inside a 4-task job starts 2 ranks, not 4.
    SIZE_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    RANK_VARS = ("SLURM_PROCID",)
    LOCAL_RANK_VARS = ("SLURM_LOCALID",)
    NODE_RANK_VARS = ("SLURM_NODEID",)

    @classmethod
    def detect(cls, env):
        return "SLURM_PROCID" in env and ("SLURM_STEP_ID" in env or "SLURM_STEPID" in env)

    def local_size(self) -> Optional[int]:
        value = self.env.get("SLURM_STEP_TASKS_PER_NODE") or self.env.get("SLURM_TASKS_PER_NODE")
        node = self.node_rank()
        if value is None or node is None:
            return None
        counts = expand_tasks_per_node(value)
        if node >= len(counts):
            raise LauncherEnvironmentError(
                f"SLURM_NODEID={node} but the tasks-per-node list {value!r} covers {len(counts)} nodes"
            )
        return counts[node]

    def nodes(self) -> Optional[List[str]]:
        nodelist = self.env.get("SLURM_STEP_NODELIST") or self.env.get("SLURM_JOB_NODELIST")
        return expand_nodelist(nodelist) if nodelist else None

from hvdtrain.distributed.environments.base import ClusterEnvironment


class OpenMPIEnvironment(ClusterEnvironment):
    """mpirun/mpiexec of Open MPI (also horovodrun over MPI, and mpirun inside a SLURM job)."""

    name = "Open MPI mpirun"
    hint = ("the mpirun on PATH must be the Open MPI that mpi4py and Horovod were built against "
            "(compare `which mpirun` with `hvdtrain info`); on SLURM, start mpirun once per job, "
            "not once per task under srun")
    RANK_VARS = ("OMPI_COMM_WORLD_RANK",)
    SIZE_VARS = ("OMPI_COMM_WORLD_SIZE",)
    LOCAL_RANK_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK",)
    LOCAL_SIZE_VARS = ("OMPI_COMM_WORLD_LOCAL_SIZE",)

    @classmethod
    def detect(cls, env):
        return "OMPI_COMM_WORLD_SIZE" in env

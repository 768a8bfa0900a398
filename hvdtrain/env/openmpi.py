from hvdtrain.env.base import ClusterEnvironment


class OpenMPIEnvironment(ClusterEnvironment):
    """mpirun/mpiexec of Open MPI (also horovodrun over MPI, and mpirun inside a SLURM job)."""

    name = "Open MPI mpirun"
    hint = ("the mpirun on PATH must be the Open MPI that mpi4py and Horovod were built against "
            "(compare `which mpirun` with `hvdtrain info`); on SLURM, start mpirun once per job, "
            "not once per task under srun")

    @classmethod
    def detect(cls, env):
        return "OMPI_COMM_WORLD_SIZE" in env

    def world_size(self):
        return self._int("OMPI_COMM_WORLD_SIZE")

    def global_rank(self):
        return self._int("OMPI_COMM_WORLD_RANK")

    def local_rank(self):
        return self._int("OMPI_COMM_WORLD_LOCAL_RANK")

    def local_size(self):
        return self._int("OMPI_COMM_WORLD_LOCAL_SIZE")

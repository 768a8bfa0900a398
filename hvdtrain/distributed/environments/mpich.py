from hvdtrain.distributed.environments.base import ClusterEnvironment


class MPICHEnvironment(ClusterEnvironment):
    """MPICH's Hydra (mpiexec) and Intel MPI: PMI_RANK/PMI_SIZE, MPI_LOCALRANKID/MPI_LOCALNRANKS."""

    name = "MPICH/Intel MPI (Hydra)"
    hint = ("Horovod and mpi4py must be built against the MPICH/Intel MPI whose mpiexec started "
            "the job; a build against Open MPI starts N separate 1-rank worlds under Hydra")
    RANK_VARS = ("PMI_RANK",)
    SIZE_VARS = ("PMI_SIZE",)
    LOCAL_RANK_VARS = ("MPI_LOCALRANKID",)
    LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS",)

    @classmethod
    def detect(cls, env):
        return "PMI_RANK" in env and "PMI_SIZE" in env

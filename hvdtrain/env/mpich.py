from hvdtrain.env.base import ClusterEnvironment


class MPICHEnvironment(ClusterEnvironment):
    """MPICH's Hydra (mpiexec) and Intel MPI: PMI_RANK/PMI_SIZE, MPI_LOCALRANKID/MPI_LOCALNRANKS."""

    name = "MPICH/Intel MPI (Hydra)"
    hint = ("Horovod and mpi4py must be built against the MPICH/Intel MPI whose mpiexec started "
            "the job; a build against Open MPI starts N separate 1-rank worlds under Hydra")

    @classmethod
    def detect(cls, env):
        return "PMI_RANK" in env and "PMI_SIZE" in env

    def world_size(self):
        return self._int("PMI_SIZE")

    def global_rank(self):
        return self._int("PMI_RANK")

    def local_rank(self):
        return self._int("MPI_LOCALRANKID")

    def local_size(self):
        return self._int("MPI_LOCALNRANKS")

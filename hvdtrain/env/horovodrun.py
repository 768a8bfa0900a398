from hvdtrain.env.base import ClusterEnvironment


class HorovodRunEnvironment(ClusterEnvironment):
    """horovodrun --gloo (and Horovod elastic): it exports HOROVOD_RANK/SIZE/LOCAL_* to each worker.

    horovodrun over MPI exports none of these; it hands over to mpirun (see OpenMPIEnvironment).
    """

    name = "horovodrun (Gloo)"
    hint = ("check that every host runs the same hvdtrain/Horovod and that horovodrun's -np "
            "matches the slots given with -H or --hostfile")

    @classmethod
    def detect(cls, env):
        return "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env

    def world_size(self):
        return self._int("HOROVOD_SIZE")

    def global_rank(self):
        return self._int("HOROVOD_RANK")

    def local_rank(self):
        return self._int("HOROVOD_LOCAL_RANK")

    def local_size(self):
        return self._int("HOROVOD_LOCAL_SIZE")

    def node_rank(self):
        return self._int("HOROVOD_CROSS_RANK")

from hvdtrain.distributed.environments.base import ClusterEnvironment


class HorovodRunEnvironment(ClusterEnvironment):
    """horovodrun --gloo (and Horovod elastic): it exports HOROVOD_RANK/SIZE/LOCAL_* to each worker.

    horovodrun over MPI exports none of these; it hands over to mpirun (see OpenMPIEnvironment).
    """

    name = "horovodrun (Gloo)"
    hint = ("check that every host runs the same hvdtrain/Horovod and that horovodrun's -np "
            "matches the slots given with -H or --hostfile")
    RANK_VARS = ("HOROVOD_RANK",)
    SIZE_VARS = ("HOROVOD_SIZE",)
    LOCAL_RANK_VARS = ("HOROVOD_LOCAL_RANK",)
    LOCAL_SIZE_VARS = ("HOROVOD_LOCAL_SIZE",)
    NODE_RANK_VARS = ("HOROVOD_CROSS_RANK",)

    @classmethod
    def detect(cls, env):
        return "HOROVOD_RANK" in env and "HOROVOD_SIZE" in env

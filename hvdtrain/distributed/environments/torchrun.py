from hvdtrain.distributed.environments.base import ClusterEnvironment


class TorchrunEnvironment(ClusterEnvironment):
    """torchrun (torch.distributed.run): its processes never meet in Horovod, so each one's Horovod
    is a world of one. Read so that a world of more than one process is refused at start instead of
    training as that many separate one-process runs."""

    name = "torchrun"
    hint = ("torchrun starts processes that Horovod does not join: each would train alone on the whole "
            "data. Start hvdtrain's ranks with `horovodrun -np N python SCRIPT` (or `mpirun -np N`, "
            "`srun --mpi=pmix`): docs/porting/from-ddp.md")
    RANK_VARS = ("RANK",)
    SIZE_VARS = ("WORLD_SIZE",)
    LOCAL_RANK_VARS = ("LOCAL_RANK",)
    LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE",)
    NODE_RANK_VARS = ("GROUP_RANK",)

    @classmethod
    def detect(cls, env):
        return "TORCHELASTIC_RUN_ID" in env

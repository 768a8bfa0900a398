from hvdtrain.distributed.environments.base import ClusterEnvironment


class PMIxEnvironment(ClusterEnvironment):
    """A PMIx launcher (prterun, Open MPI 5, a PMIx-enabled scheduler): only the rank is exported."""

    name = "PMIx"
    hint = "the launcher's PMIx must be the one Open MPI was built with (check `ompi_info | grep pmix`)"
    RANK_VARS = ("PMIX_RANK",)

    @classmethod
    def detect(cls, env):
        return "PMIX_RANK" in env

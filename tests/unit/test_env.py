import pytest

from hvdtrain.distributed import environments as env
from hvdtrain.distributed.environments.slurm import expand_tasks_per_node

HOROVODRUN_GLOO = {"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
                   "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
HYDRA = {"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}
SRUN = {"SLURM_PROCID": "5", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "6",
        "SLURM_LOCALID": "1", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
        "SLURM_STEP_NODELIST": "gpu[01-02],cpu7", "SLURM_JOB_NODELIST": "gpu[01-02],cpu[7-8]"}
# What torchrun --nproc_per_node=2 gives its second process (printed from one, the run id shortened).
TORCHRUN = {"TORCHELASTIC_RUN_ID": "ef717d89", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "46741"}
BATCH_SHELL = {"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_JOB_ID": "17",
               "SLURM_JOB_NODELIST": "gpu[01-04]"}  # the sbatch script itself: no step


@pytest.mark.parametrize("variables,name,values", [
    (HOROVODRUN_GLOO, "horovodrun (Gloo)", (3, 4, 1, 2, 1)),
    (OPEN_MPI, "Open MPI mpirun", (5, 8, 1, 4, None)),
    (HYDRA, "MPICH/Intel MPI (Hydra)", (2, 4, 0, 2, None)),
    (SRUN, "SLURM srun", (5, 6, 1, 1, 2)),
    ({"PMIX_RANK": "7"}, "PMIx", (7, None, None, None, None)),
    (TORCHRUN, "torchrun", (1, 2, 1, 2, 0)),
    ({**SRUN, **TORCHRUN}, "torchrun", (1, 2, 1, 2, 0)),
    ({}, "single process", (0, 1, 0, 1, None)),
    (BATCH_SHELL, "single process", (0, 1, 0, 1, None)),
])
def test_each_launcher_is_recognised_and_read(variables, name, values):
    found = env.detect(variables)
    assert found.name == name
    assert (found.global_rank(), found.world_size(), found.local_rank(), found.local_size(),
            found.node_rank()) == values


def test_mpirun_inside_an_sbatch_allocation_is_mpirun_not_srun():
    assert env.detect({**BATCH_SHELL, **OPEN_MPI}).name == "Open MPI mpirun"
    assert env.detect({**SRUN, **OPEN_MPI}).name == "Open MPI mpirun"


def test_srun_with_pmix_is_read_through_slurm_which_says_more():
    assert env.detect({**SRUN, "PMIX_RANK": "5"}).name == "SLURM srun"


def test_srun_step_size_wins_over_the_job_size_and_the_step_nodelist_is_expanded():
    srun = env.detect(SRUN)
    assert srun.world_size() == 6
    assert srun.nodes() == ["gpu01", "gpu02", "cpu7"]


@pytest.mark.parametrize("value,counts", [
    ("2", [2]), ("2(x3)", [2, 2, 2]), ("4(x2),1", [4, 4, 1]), ("1,2,3", [1, 2, 3]),
])
def test_tasks_per_node_expands_slurm_repetition(value, counts):
    assert expand_tasks_per_node(value) == counts


def test_malformed_variables_name_the_variable():
    with pytest.raises(env.LauncherEnvironmentError, match="OMPI_COMM_WORLD_SIZE='eight'"):
        env.detect({**OPEN_MPI, "OMPI_COMM_WORLD_SIZE": "eight"}).world_size()
    with pytest.raises(env.LauncherEnvironmentError, match=r"malformed at '2\(y3\)'"):
        env.detect({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "2(y3)"}).local_size()
    with pytest.raises(env.LauncherEnvironmentError, match="SLURM_NODEID=2 but .* covers 2 nodes"):
        env.detect({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "3(x2)"}).local_size()


def test_a_world_that_disagrees_with_the_launcher_is_refused_with_both_values_and_a_hint():
    srun = env.detect(SRUN)
    with pytest.raises(env.LauncherEnvironmentError) as error:
        env.check_world(srun, rank=0, size=1, local_rank=0, local_size=1)
    message = str(error.value)
    assert "world size: the launcher says 6, Horovod says 1 (hvd.size())" in message
    assert "rank: the launcher says 5, Horovod says 0 (hvd.rank())" in message
    assert "HINT: srun started each task as its own 1-rank MPI world: use `srun --mpi=pmix`" in message


def test_torchrun_of_two_processes_is_refused_naming_the_launchers_to_use():
    # Each torchrun process's Horovod is a world of one: unrefused, two separate runs would train.
    with pytest.raises(env.LauncherEnvironmentError) as error:
        env.check_world(env.detect(TORCHRUN), rank=0, size=1, local_rank=0, local_size=1)
    message = str(error.value)
    assert message.startswith("started by torchrun")
    assert "world size: the launcher says 2, Horovod says 1 (hvd.size())" in message
    assert "HINT: torchrun starts processes that Horovod does not join" in message
    assert "horovodrun -np N python SCRIPT" in message
    # One process under torchrun is a world of one either way: it trains.
    one = {**TORCHRUN, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.check_world(env.detect(one), rank=0, size=1, local_rank=0, local_size=1)


def test_an_agreeing_world_passes_and_unknown_values_are_not_checked():
    env.check_world(env.detect(OPEN_MPI), rank=5, size=8, local_rank=1, local_size=4)
    env.check_world(env.detect({"PMIX_RANK": "7"}), rank=7, size=16, local_rank=3, local_size=4)

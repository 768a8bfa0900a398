import pytest

from hvdtrain.distributed.startup import ENV_DEFAULTS, apply_env_defaults, threads_per_rank, threads_set_by_user
from hvdtrain.distributed.rng import rank_seed


@pytest.mark.parametrize("local_size,visible,host,expected", [
    (2, 8, 8, 4),   # unbound: two ranks share eight cores
    (4, 2, 2, 1),   # more ranks than cores: never zero threads
    (2, 1, 2, 1),   # bound to one core by the launcher: use it
    (1, 3, 16, 3),  # bound to three cores (cpuset): use those
])
def test_threads_per_rank_divides_the_host_or_keeps_the_binding(local_size, visible, host, expected):
    assert threads_per_rank(local_size, visible, host) == expected


def test_omp_num_threads_set_by_the_user_wins_and_a_bad_value_is_named():
    assert threads_set_by_user({"OMP_NUM_THREADS": "3"}) == 3
    assert threads_set_by_user({}) is None and threads_set_by_user({"OMP_NUM_THREADS": " "}) is None
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{bad}' is not a whole number >= 1"):
            threads_set_by_user({"OMP_NUM_THREADS": bad})


def test_rank_seeds_differ_per_rank_and_repeat_per_run():
    seeds = [rank_seed(42, rank) for rank in range(64)]
    assert len(set(seeds)) == 64
    assert seeds == [rank_seed(42, rank) for rank in range(64)]
    assert rank_seed(43, 0) != seeds[0]


def test_env_defaults_fill_only_what_the_user_left_unset():
    environ = {"OMPI_MCA_mpi_yield_when_idle": "0", "PATH": "/bin"}
    applied = apply_env_defaults(environ)
    # The user's 0 (busy-poll) wins; the other defaults are set and reported.
    assert environ["OMPI_MCA_mpi_yield_when_idle"] == "0"
    assert "OMPI_MCA_mpi_yield_when_idle" not in applied
    assert applied == {k: v for k, v in ENV_DEFAULTS.items() if k != "OMPI_MCA_mpi_yield_when_idle"}
    assert all(environ[k] == v for k, v in applied.items())
    assert environ["PATH"] == "/bin"


def test_env_defaults_ask_open_mpi_to_yield_when_idle_and_are_set_once():
    environ = {}
    assert apply_env_defaults(environ)["OMPI_MCA_mpi_yield_when_idle"] == "1"
    assert apply_env_defaults(environ) == {}  # a second init changes nothing and reports nothing
    assert environ == ENV_DEFAULTS

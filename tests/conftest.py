"""Shared by every test launch: no test leaks environment variables into the next, and the
one-process launch (tests/unit and tests/launch, two files at a time under pytest-xdist) starts the
slowest launch files first.

Why the order matters: pytest-xdist hands each worker a whole file at a time, by default the files
with the most tests first. The slowest files (a few tests, each starting several jobs) then came
last, and one worker ran the last of them alone for minutes while the other had nothing left (CI:
1680 s for 3320 s of tests on 2 workers). Longest first, with the many short unit files filling the
gaps at the end, the two workers finish within a few seconds of each other: 1660 s for the same
tests (a replay of that CI run's per-test times through xdist's scheduling; 1748 s replayed in
xdist's own order). scripts/run_tests.sh turns xdist's own ordering off (--no-loadscope-reorder) so
that this one holds.
"""
import os

import pytest

# Set by libraries when first imported or used, not by tests: torch's compile cache and the
# pointer Inductor hands its compiled kernels (set again before every load: removing it is harmless),
# the OpenMP switches scikit-learn sets on import, and the address of W&B's service process, which
# its first run starts for the rest of the process (train.loggers=[wandb]).
_SET_BY_LIBRARIES = {"TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "KMP_DUPLICATE_LIB_OK",
                     "KMP_INIT_AT_FORK", "WANDB_SERVICE"}


@pytest.fixture(autouse=True)
def restore_environment():
    """A test that leaks an environment variable into the next one fails loudly instead."""
    saved = dict(os.environ)
    yield
    leaked = set(os.environ) - set(saved) - _SET_BY_LIBRARIES
    os.environ.clear()
    os.environ.update(saved)
    assert not leaked, f"test left environment variables behind: {sorted(leaked)}"


# The launch files that take longest (seconds, every test of the file, the CI run above), longest
# first; a file not named keeps its place after them, tests/launch before tests/unit. A guess that is
# off costs only the balance of the two workers, never a test: tests/unit/test_test_order.py checks
# that every name is a file of the suite.
SLOWEST_FIRST = (
    "tests/launch/test_out_of_memory.py",        # 393
    "tests/launch/test_bench_throughput.py",     # 243
    "tests/launch/test_main_job.py",             # 241
    "tests/launch/test_resharding.py",           # 228
    "tests/launch/test_elastic.py",              # 211
    "tests/launch/test_resume.py",               # 199
    "tests/launch/test_model_parallel_launch.py",  # 175
    "tests/launch/test_finetune_ports.py",       # 170
    "tests/launch/test_bench_strategies.py",     # 145
    "tests/launch/test_async_checkpoint.py",     # 139
    "tests/launch/test_layout_sweep.py",         # 133
    "tests/launch/test_sharded_resume.py",       # 104
)


def file_rank(path: str) -> tuple:
    """Where a test file runs in the one-process launch: the slowest named first, in their order; then
    the rest of tests/launch; then everything else (tests/unit), each in pytest's own order."""
    if path in SLOWEST_FIRST:
        return (0, SLOWEST_FIRST.index(path))
    return (1, 0) if path.startswith("tests/launch/") else (2, 0)


def pytest_collection_modifyitems(config, items):
    # A stable sort: within a file, and among the files of one rank, pytest's order is kept.
    items.sort(key=lambda item: file_rank(item.nodeid.split("::", 1)[0]))

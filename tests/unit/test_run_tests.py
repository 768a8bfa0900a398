"""scripts/run_tests.sh's own settings: the one-process launch starts its slowest launch files first
(tests/conftest.py) and xdist keeps that order; every launch's torch threads wait without spinning."""
import os
import shutil
import stat
import subprocess
import sys

from tests.conftest import SLOWEST_FIRST
from tests.launch.helpers import ROOT


def test_every_file_named_slowest_is_a_test_file_of_the_suite_named_once():
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)
    missing = [path for path in SLOWEST_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"renamed or removed: update SLOWEST_FIRST in tests/conftest.py: {missing}"


def test_collection_puts_the_slowest_first_then_launch_then_unit_keeping_order_within_a_file():
    files = ["tests/unit/test_slurm_scripts.py", "tests/launch/test_doctor.py", "tests/launch/test_elastic.py",
             "tests/launch/test_out_of_memory.py"]
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    nodeids = [line for line in listed.stdout.splitlines() if "::" in line]
    order = list(dict.fromkeys(nodeid.split("::")[0] for nodeid in nodeids))
    assert order == ["tests/launch/test_out_of_memory.py", "tests/launch/test_elastic.py",
                     "tests/launch/test_doctor.py", "tests/unit/test_slurm_scripts.py"]
    # within a file, pytest's own order (the order of definition)
    unit = [nodeid for nodeid in nodeids if nodeid.startswith("tests/unit/test_slurm_scripts.py")]
    source = (ROOT / "tests/unit/test_slurm_scripts.py").read_text()
    names = [nodeid.split("::")[1].split("[")[0] for nodeid in unit]
    assert names == sorted(names, key=lambda name: source.index(f"def {name}("))


def stub(path, body):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_every_launch_waits_without_spinning_and_the_one_process_launch_keeps_the_collection_order(tmp_path):
    """run_tests.sh run for real over stand-ins: its python records each call's OMP_WAIT_POLICY and
    arguments; mpirun and horovodrun start their command once (as rank 0)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "run_tests.sh", tmp_path / "scripts")
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "calls"
    stub(bin_dir / "python", f'echo "$OMP_WAIT_POLICY $*" >> {calls}\n')
    for launcher in ("mpirun", "horovodrun"):  # their options end where the command, sh -c ..., starts
        stub(bin_dir / launcher, 'while [ "$1" != sh ]; do shift; done\nOMPI_COMM_WORLD_RANK=0 HOROVOD_RANK=0 exec "$@"\n')
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    done = subprocess.run(["bash", str(tmp_path / "scripts" / "run_tests.sh")], env=dict(env, VENV=str(tmp_path / "venv")),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = calls.read_text().splitlines()
    tests = [line for line in lines if " -m pytest " in line]
    assert len(tests) == 8 and lines[-1].endswith("scripts/summarize_tests.py " + str(tmp_path / ".cache/test-results"))
    assert all(line.startswith("PASSIVE ") for line in lines), lines
    (single,) = [line for line in tests if "tests/unit tests/launch" in line]
    assert "--dist loadfile --no-loadscope-reorder" in single

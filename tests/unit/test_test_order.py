"""The one-process launch starts its slowest launch files first (tests/conftest.py), and xdist keeps
that order (scripts/run_tests.sh)."""
import subprocess
import sys

from tests.conftest import SLOWEST_FIRST
from tests.launch.helpers import ROOT


def test_every_file_named_slowest_is_a_test_file_of_the_suite_named_once():
    assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)
    missing = [path for path in SLOWEST_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"renamed or removed: update SLOWEST_FIRST in tests/conftest.py: {missing}"


def test_collection_puts_the_slowest_first_then_launch_then_unit_keeping_order_within_a_file():
    files = ["tests/unit/test_slurm_scripts.py", "tests/launch/test_doctor.py", "tests/launch/test_finetune_ports.py",
             "tests/launch/test_out_of_memory.py"]
    listed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stdout[-3000:] + listed.stderr[-3000:]
    nodeids = [line for line in listed.stdout.splitlines() if "::" in line]
    order = list(dict.fromkeys(nodeid.split("::")[0] for nodeid in nodeids))
    assert order == ["tests/launch/test_out_of_memory.py", "tests/launch/test_finetune_ports.py",
                     "tests/launch/test_doctor.py", "tests/unit/test_slurm_scripts.py"]
    # within a file, pytest's own order (the order of definition)
    unit = [nodeid for nodeid in nodeids if nodeid.startswith("tests/unit/test_slurm_scripts.py")]
    source = (ROOT / "tests/unit/test_slurm_scripts.py").read_text()
    names = [nodeid.split("::")[1].split("[")[0] for nodeid in unit]
    assert names == sorted(names, key=lambda name: source.index(f"def {name}("))


def test_the_one_process_launch_keeps_the_collection_order():
    """Without --no-loadscope-reorder, xdist hands out the files with the most tests first."""
    script = (ROOT / "scripts" / "run_tests.sh").read_text()
    (line,) = [line for line in script.splitlines() if "--dist loadfile" in line]
    assert "--no-loadscope-reorder" in line

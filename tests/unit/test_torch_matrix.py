"""scripts/torch_matrix.py: its table says what ran and how it went, and never invents a result."""
import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))  # the script imports its neighbour summarize_tests
spec = importlib.util.spec_from_file_location("torch_matrix", SCRIPTS / "torch_matrix.py")
matrix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(matrix)
sys.path.remove(str(SCRIPTS))


def junit(path: Path, cases: dict) -> None:
    body = "".join(f'<testcase classname="t" name="{name}">'
                   + {"passed": "", "failed": "<failure/>", "skipped": "<skipped/>"}[outcome] + "</testcase>"
                   for name, outcome in cases.items())
    path.write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")


def test_core_counts_a_test_once_failed_in_any_rank(tmp_path):
    junit(tmp_path / "unit.xml", {"a": "passed", "b": "skipped", "c": "passed"})
    junit(tmp_path / "mpi-rank0.xml", {"x": "passed", "y": "passed"})
    junit(tmp_path / "mpi-rank1.xml", {"x": "passed", "y": "failed"})
    assert matrix.count_core(tmp_path, 1, 2) == {"passed": 3, "failed": 1, "skipped": 1}


def test_a_launch_without_results_is_a_failure(tmp_path):
    junit(tmp_path / "unit.xml", {"a": "passed"})
    junit(tmp_path / "mpi-rank0.xml", {"x": "passed"})  # rank 1 crashed before writing its file
    assert matrix.count_core(tmp_path, 1, 2) == {"passed": 1, "failed": 1, "skipped": 0}


def test_table_rows_in_version_order_and_unrun_versions_say_so():
    results = {
        "2.10.0": {"version": "2.10.0", "status": "run", "torch": "2.10.0+cu128", "nccl": True, "setup_ok": True,
                   "horovod_built": True, "setup_s": 400, "passed": 10, "failed": 0, "skipped": 2, "core_s": 300},
        "2.9.1": {"version": "2.9.1", "status": "run", "setup_ok": False, "setup_s": 90,
                  "note": "[setup] ERROR: Horovod build failed"},
        "2.6.0": {"version": "2.6.0", "status": "not run", "reason": "4 GB download"},
        "2.13.0": {"version": "2.13.0", "status": "run", "torch": "2.13.0+cpu", "nccl": False, "setup_ok": True,
                   "setup_s": 200, "passed": 9, "failed": 1, "skipped": 0, "core_s": 250},
        "2.8.0": None,
        "2.7.1": {"version": "2.7.1", "status": "run", "torch": "2.7.1+cu126", "nccl": False, "setup_ok": True,
                  "without_nccl": "HOROVOD_NCCL=0: torch CUDA 12.6, toolkit here CUDA 13.0", "horovod_built": True,
                  "setup_s": 300, "passed": 10, "failed": 0, "skipped": 2, "core_s": 200},
    }
    rows = matrix.render_table(results).splitlines()[2:]
    assert rows == [
        "| 2.6.0 | not run here: 4 GB download | | | |",
        "| 2.7.1+cu126, Horovod without NCCL (HOROVOD_NCCL=0: torch CUDA 12.6, toolkit here CUDA 13.0) "
        "| ok, 300 s (Horovod built) | 10 / 0 / 2 | 200 s | passes |",
        "| 2.8.0 | not run here: no result recorded | | | |",
        "| 2.9.1 | failed, 90 s: [setup] ERROR: Horovod build failed | | | |",
        "| 2.10.0+cu128, Horovod with NCCL | ok, 400 s (Horovod built) | 10 / 0 / 2 | 300 s | passes |",
        "| 2.13.0+cpu | ok, 200 s (Horovod wheel cached) | 9 / 1 / 0 | 250 s | fails |",
    ]


def test_the_table_replaces_only_the_part_between_the_markers(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# Title\n\n{matrix.START_MARK}\nold table\n{matrix.END_MARK}\n\nAfter.\n")
    matrix.replace_table(page, "| new |")
    assert page.read_text() == f"# Title\n\n{matrix.START_MARK}\n| new |\n{matrix.END_MARK}\n\nAfter.\n"
    page.write_text("# A page without markers\n")
    with pytest.raises(SystemExit, match="torch-matrix:start"):
        matrix.replace_table(page, "| new |")


@pytest.mark.parametrize("item", ["2.7.1", "2.7.1=", "two=reason"])
def test_bad_not_run_items_say_how_to_write_them(item):
    with pytest.raises((SystemExit, ValueError), match="VERSION=REASON|numbers and dots"):
        matrix.parse_not_run([item])


def test_the_docs_page_carries_the_markers():
    text = matrix.PAGE.read_text()
    assert text.count(matrix.START_MARK) == 1 and text.count(matrix.END_MARK) == 1


def test_only_a_cuda_major_mismatch_is_set_up_again_without_nccl():
    refusal = ("[setup] ERROR: torch 2.6.0+cu124 is built for CUDA 12.4, but the CUDA toolkit here "
               "(/usr/local/cuda-13.0) is CUDA 13.0: Horovod's torch binding must be built with a CUDA 12 toolkit.")
    assert matrix.cuda_mismatch(refusal) == "torch CUDA 12.4, toolkit here CUDA 13.0"
    assert matrix.cuda_mismatch("[setup] ERROR: Horovod build failed; see build.log") is None

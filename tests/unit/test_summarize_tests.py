"""The suite's own summary must not hide a failure in one rank or a launch that never reported."""
import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "summarize_tests.py"
spec = importlib.util.spec_from_file_location("summarize_tests", SCRIPT)
summarize = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summarize)


def junit(path: Path, cases: dict) -> None:
    body = "".join(
        f'<testcase classname="t" name="{name}">'
        + {"passed": "", "failed": "<failure/>", "skipped": "<skipped/>"}[outcome]
        + "</testcase>"
        for name, outcome in cases.items()
    )
    path.write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')


def write_all(tmp_path, rank1_cases):
    (tmp_path / "phases.tsv").write_text("single\t0\tone process\nmpi\t2\tmpirun -np 2\n"
                                         "gloo\t2\thorovodrun -np 2 --gloo\nmpi4\t4\tmpirun -np 4\n"
                                         "cluster\t0\ttwo-host cluster\n")
    junit(tmp_path / "single.xml", {"a": "passed", "b": "skipped"})
    junit(tmp_path / "cluster.xml", {"c": "passed"})
    for phase in ("mpi", "gloo"):
        junit(tmp_path / f"{phase}-rank0.xml", {"x": "passed", "y": "passed"})
        junit(tmp_path / f"{phase}-rank1.xml", rank1_cases)
    for rank in range(4):
        junit(tmp_path / f"mpi4-rank{rank}.xml", {"z": "passed"})


def test_all_green_counts_each_test_once_per_launch(tmp_path, capsys):
    write_all(tmp_path, {"x": "passed", "y": "passed"})
    assert summarize.main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "total: 7 passed, 0 failed, 1 skipped"


@pytest.mark.parametrize("rank1_cases", [
    {"x": "passed", "y": "failed"},   # fails in one rank only
    {"x": "passed"},                  # one rank never ran y
])
def test_a_test_that_fails_or_is_missing_in_one_rank_fails(tmp_path, capsys, rank1_cases):
    write_all(tmp_path, rank1_cases)
    assert summarize.main([str(tmp_path)]) == 1
    assert "total: 5 passed, 2 failed, 1 skipped" in capsys.readouterr().out


def test_a_launch_without_results_fails(tmp_path, capsys):
    write_all(tmp_path, {"x": "passed", "y": "passed"})
    (tmp_path / "gloo-rank1.xml").unlink()
    assert summarize.main([str(tmp_path)]) == 1
    assert "no results from gloo-rank1.xml" in capsys.readouterr().out


def test_a_four_rank_launch_missing_one_rank_fails(tmp_path, capsys):
    write_all(tmp_path, {"x": "passed", "y": "passed"})
    (tmp_path / "mpi4-rank3.xml").unlink()
    assert summarize.main([str(tmp_path)]) == 1
    assert "mpirun -np 4: no results from mpi4-rank3.xml" in capsys.readouterr().out


def test_a_malformed_phase_line_names_it(tmp_path):
    write_all(tmp_path, {"x": "passed", "y": "passed"})
    (tmp_path / "phases.tsv").write_text("single\t0\tone process\nmpi two\n")
    with pytest.raises(ValueError, match="line 2"):
        summarize.main([str(tmp_path)])

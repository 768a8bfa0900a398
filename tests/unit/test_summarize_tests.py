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
    junit(tmp_path / "single.xml", {"a": "passed", "b": "skipped"})
    junit(tmp_path / "cluster.xml", {"c": "passed"})
    for phase in ("mpi", "gloo"):
        junit(tmp_path / f"{phase}-rank0.xml", {"x": "passed", "y": "passed"})
        junit(tmp_path / f"{phase}-rank1.xml", rank1_cases)


def test_all_green_counts_each_test_once_per_launch(tmp_path, capsys):
    write_all(tmp_path, {"x": "passed", "y": "passed"})
    assert summarize.main([str(tmp_path), "--ranks", "2"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "total: 6 passed, 0 failed, 1 skipped"


@pytest.mark.parametrize("rank1_cases", [
    {"x": "passed", "y": "failed"},   # fails in one rank only
    {"x": "passed"},                  # one rank never ran y
])
def test_a_test_that_fails_or_is_missing_in_one_rank_fails(tmp_path, capsys, rank1_cases):
    write_all(tmp_path, rank1_cases)
    assert summarize.main([str(tmp_path), "--ranks", "2"]) == 1
    assert "total: 4 passed, 2 failed, 1 skipped" in capsys.readouterr().out


def test_a_launch_without_results_fails(tmp_path, capsys):
    write_all(tmp_path, {"x": "passed", "y": "passed"})
    (tmp_path / "gloo-rank1.xml").unlink()
    assert summarize.main([str(tmp_path), "--ranks", "2"]) == 1
    assert "no results from gloo-rank1.xml" in capsys.readouterr().out

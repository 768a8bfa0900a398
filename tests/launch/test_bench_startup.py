"""``hvdtrain bench startup`` runs for real, tiny: complete, sane output (never speed).

What must hold whatever the machine: rank 0's phases add up to its clock's total, the launcher's
share is positive and small beside it, and the process imported torch before hvdtrain.init().
"""
import json

import pytest

from hvdtrain.common.startup_clock import PHASES, record_key
from tests.launch.helpers import BIN, run

TIMEOUT = 240  # one 2-rank job of two steps: the start-up it measures is all it does


@pytest.mark.timeout(TIMEOUT + 30)
def test_the_bench_splits_the_start_up_into_phases_that_add_up(tmp_path):
    out = tmp_path / "out"
    code, stdout, stderr = run([str(BIN / "hvdtrain"), "bench", "startup", "--workers", "2", "--compile-workers", "0",
                                "--rounds", "1", "--timeout", "180", "--out", str(out)], timeout=TIMEOUT)
    assert code == 0, f"exit {code}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    result = json.loads((out / "startup.json").read_text())
    row, = result["rows"]
    run_, = result["runs"]["eager/2"]
    phases = [run_[record_key(phase)] for phase in PHASES]

    assert row["variant"] == "eager" and row["workers"] == 2
    assert min(phases) >= 0 and abs(sum(phases) - run_["total_s"]) < 1e-6, run_
    assert phases[0] > 0.1, run_  # torch's import
    # mpirun starts the ranks within seconds; a clock read at the wrong moment would be off by minutes or negative.
    assert 0 < run_["launcher_s"] < run_["launch_to_first_step_s"], run_
    assert result["import_torch_s"][0] > 0 and "launch to first step s" in stdout

"""A rank that skips a collective: the watchdog fires, every rank's flight record is in the run
directory, and the analysis names the rank and the collective it never entered."""
import json
import subprocess

from tests.launch.helpers import BIN, PYTHON, run

HVDTRAIN = str(BIN / "hvdtrain")


def test_a_skipped_collective_is_named_from_the_flight_records(tmp_path):
    # The stall must be the one at step 3: a timeout shorter than set-up can last on a loaded machine
    # (8 s measured in CI with two test files at once: a rank waits in a set-up broadcast while the
    # other measures its peak and counts the model's FLOPs) fires in set-up, before any flight record.
    code, out, err = run(["mpirun", "-np", "2", PYTHON, "tests/launch/flight_job.py", str(tmp_path), "20"], timeout=180)
    output = out + err
    assert code != 0, output[-3000:]
    run_dir = tmp_path / "flight"
    for rank in (0, 1):
        assert f"Flight record: {run_dir / 'flight' / f'rank-{rank:05d}.json'}." in output, output[-3000:]
        record = json.loads((run_dir / "flight" / f"rank-{rank:05d}.json").read_text())
        assert record["reason"] == "stall" and record["stacks"]
    # Rank 0 waits in the extra all-reduce, which is no gradient reduction of the strategy's: its
    # own line names it from the flight record, rather than saying it stopped calling collectives.
    assert "STALL rank 0" in output and "waiting in allreduce 'flight.extra'" in output, output[-3000:]
    # The verdict the stall report ends with, and the command's, name rank 1 and the collective.
    expected = "where rank 0 entered allreduce 'flight.extra'"
    assert "[hvdtrain] flight records: rank 1 entered allreduce" in output and expected in output, output[-3000:]
    analyzed = subprocess.run([HVDTRAIN, "debug", "analyze", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert analyzed.returncode == 0, analyzed.stderr
    verdict = analyzed.stdout.splitlines()[0]
    assert verdict.startswith("rank 1 entered allreduce") and expected in verdict
    assert "it never entered 'flight.extra'" in verdict, verdict

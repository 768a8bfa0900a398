"""A rank that skips a collective: the watchdog fires, every rank's flight record is in the run
directory, and the analysis names the rank and the collective it never entered; and while the
ranks hang, ``hvdtrain debug dump`` reaches every rank of a host."""
import json
import subprocess
import time

import pytest

from hvdtrain.common.flight.dumps import host_mailbox
from tests.launch.helpers import BIN, PYTHON, ROOT, kill_session, launch_env, run

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


@pytest.mark.timeout(300)
def test_hvdtrain_debug_dump_reaches_every_rank_of_a_host(tmp_path):
    """Two ranks on one host, hanging in a collective after step 3 (no stall timeout within the
    test): only local rank 0 reads the request file; rank 1 learns of it through the host's memory
    (/dev/shm). Both write their record."""
    run_dir = tmp_path / "flight"
    alive = run_dir / "flight" / "alive"
    process = subprocess.Popen(["mpirun", "-np", "2", PYTHON, "tests/launch/flight_job.py", str(tmp_path), "600"],
                               cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while len(list(alive.glob("rank-*.json"))) < 2:
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the ranks did not announce themselves in time"
            time.sleep(0.2)
        dumped = subprocess.run([HVDTRAIN, "debug", "dump", str(run_dir), "--timeout", "60"], capture_output=True,
                                text=True, timeout=120)
    finally:
        kill_session(process.pid)
        process.communicate()
        host_mailbox(run_dir / "flight").unlink(missing_ok=True)  # local rank 0 was killed: it could not
    assert dumped.returncode == 0, dumped.stderr
    assert dumped.stdout.split() == [str(run_dir / "flight" / f"rank-{rank:05d}.json") for rank in (0, 1)]

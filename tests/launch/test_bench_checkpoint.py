"""``hvdtrain bench checkpoint`` runs for real, tiny: complete, sane output (never speed).

What must hold whatever the machine: every save of a job was timed, the files the jobs wrote have
the model's size, and the asynchronous jobs kept a host copy of exactly what they wrote.
"""
import json

import pytest

from tests.launch.helpers import BIN, run

TIMEOUT = 240  # 3 jobs (no saves, synchronous, asynchronous) of a few seconds, start-up dominating
SAVES = 2


@pytest.mark.timeout(TIMEOUT + 30)
def test_the_bench_times_every_save_and_reports_the_ratio(tmp_path):
    out = tmp_path / "out"
    code, stdout, stderr = run([str(BIN / "hvdtrain"), "bench", "checkpoint", "--workers", "2", "--formats", "full",
                                "--rounds", "1", "--model", "cnn", "--saves", str(SAVES), "--every", "2",
                                "--batch", "8", "--timeout", "120", "--out", str(out)], timeout=TIMEOUT)
    assert code == 0, f"exit {code}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    result = json.loads((out / "checkpoint.json").read_text())
    row, = result["rows"]
    runs = {key.split("/")[-1]: value[0] for key, value in result["runs"].items()}

    assert row["workers"] == 2 and row["format"] == "full" and row["strategy"] == "ddp"
    assert runs["none"]["stalls_s"] == [] and len(runs["sync"]["stalls_s"]) == len(runs["async"]["stalls_s"]) == SAVES
    assert all(s > 0 for mode in ("sync", "async") for s in runs[mode]["stalls_s"])
    # The small CNN: 1.24M float32 parameters and Adam's two moments, 14.9 MB, plus the pickle's few KB.
    assert 12 * 1_240_000 < row["checkpoint_bytes"] < 12 * 1_240_000 + 2_000_000, row["checkpoint_bytes"]
    # Rank 0 keeps a host copy of the state it writes; the other rank writes nothing in the full format.
    copies = runs["async"]["snapshot_bytes"]
    assert 12 * 1_240_000 < copies[0] <= row["checkpoint_bytes"] and copies[1] == 0, copies
    assert row["stall_ratio"] == row["async_stall_s"] / row["sync_stall_s"]
    assert "async/sync" in stdout and "target async stall" in stdout

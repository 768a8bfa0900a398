"""A run over a stream (files read by a function, no len(), no index) killed with SIGKILL mid-epoch
and started again ends exactly where an uninterrupted run ends: the checkpoint's epoch position is
the count of stream samples already trained on, and the resumed epoch skips that many.

Float64 throughout. Resumed at the same worker count the arithmetic is the same: bitwise equal.
Resumed on 1 worker (the global batch kept), the all-reduce adds the same numbers in another
order: ~1e-16 relative per operation, far below the 1e-10 bound after 24 steps, while a wrong
resume (a sample skipped or repeated, another order) moves the weights by 1e-3 or more.
"""
import shutil

import pytest
import torch

from tests.launch.helpers import PYTHON, kill_when, run

LAST_STEP = 24  # 2 epochs of 100 samples in whole global batches of 8 (4 per worker x 2)
KILL_AFTER = 15  # a checkpoint_every step inside the second epoch
ACROSS_WORKER_COUNTS = 1e-10


def argv(np, data, checkpoints):
    return ["mpirun", "-np", str(np), "--oversubscribe", PYTHON, "tests/launch/stream_job.py", str(data),
            str(checkpoints)]


def final_model(checkpoints):
    path = checkpoints / f"ckpt-{LAST_STEP:09d}.pt"
    assert path.exists(), f"the run did not end at step {LAST_STEP}: {sorted(p.name for p in checkpoints.iterdir())}"
    return torch.load(path, weights_only=True)["model"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("stream")
    data, whole, killed = base / "data", base / "whole", base / "killed"
    code, out, err = run(argv(2, data, whole))
    assert code == 0, err[-3000:]
    kill_when(argv(2, data, killed), killed / f"ckpt-{KILL_AFTER:09d}.pt")
    written = sorted(p.name for p in killed.glob("ckpt-*.pt"))
    assert f"ckpt-{LAST_STEP:09d}.pt" not in written, f"the kill came too late to prove anything: {written}"
    snapshot = base / "at-kill"
    shutil.copytree(killed, snapshot)
    return data, whole, killed, snapshot


def test_a_stream_run_killed_mid_epoch_resumes_to_bitwise_the_same_weights(runs):
    data, whole, killed, _ = runs
    code, out, err = run(argv(2, data, killed))
    assert code == 0, err[-3000:]
    assert "resuming from" in out and f"trained to step {LAST_STEP}" in out
    expected, resumed = final_model(whole), final_model(killed)
    assert expected["0.weight"].dtype == torch.float64
    for key, tensor in expected.items():
        assert torch.equal(tensor, resumed[key]), f"{key} differs after resume"


def test_a_2_worker_stream_checkpoint_resumes_on_1_worker(runs, tmp_path):
    data, whole, _, snapshot = runs
    moved = tmp_path / "ckpt"
    shutil.copytree(snapshot, moved)
    code, out, err = run(argv(1, data, moved))
    assert code == 0, err[-3000:]
    assert "resuming a checkpoint of 2 data-parallel workers" in out, out[-2000:]
    expected, resumed = final_model(whole), final_model(moved)
    for key, tensor in expected.items():
        difference = (resumed[key] - tensor).abs().max().item()
        assert difference < ACROSS_WORKER_COUNTS, f"{key} after resuming on 1 worker: max |difference| {difference:.3g}"

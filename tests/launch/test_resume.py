"""A run killed with SIGKILL and started again ends exactly where an uninterrupted run ends,
and a checkpoint written at 2 workers resumes at 1 and at 4 with the same global batch.

The runs train in float64 (--model.dtype=float64). Resumed on the same worker count, the
arithmetic is the same, so the result is bitwise equal. Resumed on another worker count, the
gradient all-reduce adds the same numbers in another order, and torch's kernels sum in an order
that depends on the CPU's vector width (AVX2, AVX-512): rounding differs by ~1e-16 relative per
operation. In float32 that is ~1e-7 per operation, and 36 steps of SGD grow it to 1e-5..1e-4,
above any fixed float32 tolerance on some CPU; in float64 the same growth stays below 1e-12.
A resume that is wrong (global batch, sample order, learning rate, optimizer state) moves the
parameters by 1e-4 or more. So the bound, 1e-10, sits orders of magnitude from both.
"""
import re
import shutil
import signal
import subprocess
import time

import pytest
import torch

from tests.launch.helpers import PYTHON, ROOT, kill_session, kill_when, launch_env, run

EPOCHS, EVERY = 3, 10
LAST_STEP = EPOCHS * 22  # 1438 digits hold 22 whole global batches of 64
# float64 rounding differences (another summation order) after 36 steps stay below 1e-12; any
# wrong resume moves parameters or momentum by 1e-4 or more (see the module's docstring).
ACROSS_WORKER_COUNTS = 1e-10


def train_argv(np, checkpoint_dir):
    return ["mpirun", "-np", str(np), "--oversubscribe", PYTHON, "train.py", "--epochs", str(EPOCHS),
            "--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(EVERY),
            f"--train.run_dir={checkpoint_dir.parent / 'runs'}", "--model.dtype=float64"]


def final_state(checkpoint_dir):
    path = checkpoint_dir / f"ckpt-{LAST_STEP:09d}.pt"
    written = sorted(p.name for p in checkpoint_dir.glob("ckpt-*.pt"))
    # Another global batch or sample order ends the run at another step.
    assert path.exists(), f"the run did not end with {path.name}; it wrote {written}"
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run, and a run killed right after its step-30 checkpoint."""
    base = tmp_path_factory.mktemp("resume")
    whole, killed = base / "whole", base / "killed"
    code, out, err = run(train_argv(2, whole))
    assert code == 0, err[-3000:]
    kill_when(train_argv(2, killed), killed / f"ckpt-{3 * EVERY:09d}.pt")
    snapshot = base / "at-kill"
    shutil.copytree(killed, snapshot)
    return whole, killed, snapshot


def test_a_run_killed_mid_epoch_resumes_to_bitwise_the_same_parameters(runs):
    whole, killed, _ = runs
    steps_left = sorted(p.name for p in killed.glob("ckpt-*.pt"))
    code, out, err = run(train_argv(2, killed))
    assert code == 0, err[-3000:]
    assert "resuming from" in out and f"step {LAST_STEP}" in out
    assert f"ckpt-{LAST_STEP:09d}.pt" not in steps_left, "the kill came too late to prove anything"
    expected, resumed = final_state(whole), final_state(killed)
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), f"model {key} differs after resume"
    for index, state in expected["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], resumed["optimizer"]["state"][index]["momentum_buffer"])


@pytest.mark.parametrize("np", [1, 4])
def test_a_2_worker_checkpoint_resumes_on_another_worker_count(runs, tmp_path, np):
    whole, _, snapshot = runs
    moved = tmp_path / "ckpt"
    shutil.copytree(snapshot, moved)
    code, out, err = run(train_argv(np, moved))
    assert code == 0, err[-3000:]
    assert f"resuming a checkpoint of 2 data-parallel workers (2 ranks) on {np}: the global batch stays 64" in out
    expected, resumed = final_state(whole), final_state(moved)
    assert resumed["global_batch"] == 64 and resumed["world_size"] == np
    assert expected["model"]["features.0.weight"].dtype == torch.float64
    momentum = {index: state["momentum_buffer"] for index, state in expected["optimizer"]["state"].items()}
    resumed_momentum = {index: state["momentum_buffer"] for index, state in resumed["optimizer"]["state"].items()}
    for name, want, got in [(f"model {key}", tensor, resumed["model"][key]) for key, tensor in expected["model"].items()] \
            + [(f"momentum of parameter {i}", m, resumed_momentum[i]) for i, m in momentum.items()]:
        difference = (got - want).abs().max().item()
        assert difference < ACROSS_WORKER_COUNTS, f"{name} after resuming on {np} workers: max |difference| {difference:.3g}"


def test_a_preemption_signal_checkpoints_at_a_step_boundary_and_the_rerun_ends_bitwise_equal(runs, tmp_path):
    """SIGUSR1 to mpirun (as SLURM sends before preemption) reaches every rank: they agree,
    checkpoint, exit 0; started again, the run ends where the uninterrupted one did."""
    whole, _, _ = runs
    directory = tmp_path / "preempted"
    env = launch_env()
    process = subprocess.Popen(train_argv(2, directory), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (directory / f"ckpt-{EVERY:09d}.pt").exists():
            assert process.poll() is None and time.monotonic() < deadline, "no first checkpoint"
            time.sleep(0.02)
        process.send_signal(signal.SIGUSR1)
        out, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            kill_session(process.pid)
    assert process.returncode == 0, err[-3000:]
    stopped = re.search(r"preempted at step (\d+); run again to resume", out)
    assert stopped, out[-3000:]
    step = int(stopped.group(1))
    assert step % 10 == 0 and step < LAST_STEP, "ranks stop together at a vote step, before the end"
    assert (directory / f"ckpt-{step:09d}.pt").exists()

    code, out, err = run(train_argv(2, directory))
    assert code == 0, err[-3000:]
    assert f"resumed at epoch {step // 22}, step {step}" in out
    expected, resumed = final_state(whole), final_state(directory)
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), f"model {key} differs after preemption"

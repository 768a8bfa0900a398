"""Sharded checkpoints end to end, with the digits example in float64 under zero2 on 2 workers:
a run killed with SIGKILL right after a checkpoint and started again ends bitwise where an
uninterrupted run ends; 1 worker resumes it as it is (resharded on load); and `hvdtrain checkpoint
consolidate` makes it a full checkpoint that 1 worker under fsdp resumes."""
import re

import torch
from safetensors.torch import load_file

from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.consolidate import consolidate
from tests.launch.helpers import BIN, PYTHON, kill_when, run

LAST_STEP, EVERY = 22, 5  # one epoch: 1438 digits hold 22 whole global batches of 64


def train_argv(np, checkpoint_dir, strategy="zero2", checkpoint_format="sharded"):
    return ["mpirun", "-np", str(np), "--oversubscribe", PYTHON, "train.py", "--epochs", "1",
            "--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(EVERY),
            f"--train.run_dir={checkpoint_dir.parent / 'runs'}", "--model.dtype=float64",
            f"--train.strategy={strategy}", f"--train.checkpoint_format={checkpoint_format}"]


def accuracy(out):
    found = re.search(r"final validation accuracy: (\S+)", out)
    assert found, out[-3000:]
    return found.group(1)


def test_killed_resumed_resharded_consolidated_and_resumed_by_another_strategy(tmp_path):
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    code, out, err = run(train_argv(2, whole))
    assert code == 0, err[-3000:]
    expected_accuracy = accuracy(out)
    kill_when(train_argv(2, killed), killed / sharded.directory_name(2 * EVERY) / sharded.MANIFEST)
    at_kill = sorted(p.name for p in killed.iterdir())
    code, out, err = run(train_argv(2, killed))
    assert code == 0, err[-3000:]

    final = sharded.directory_name(LAST_STEP)
    assert final not in at_kill, f"the kill came too late to prove anything: {at_kill}"
    assert f"resuming from {killed}/ckpt-" in out
    expected, resumed = consolidate(whole / final), consolidate(killed / final)
    assert expected["model"]["features.0.weight"].dtype == torch.float64
    for key, tensor in expected["model"].items():
        assert torch.equal(tensor, resumed["model"][key]), f"model {key} differs after resume"
    for index, state in expected["optimizer"]["state"].items():
        assert torch.equal(state["momentum_buffer"], resumed["optimizer"]["state"][index]["momentum_buffer"])

    # 1 worker resumes 2 workers' shards as they are (resharded on load): at the last step it has
    # nothing left to train and evaluates the same model.
    code, out, err = run(train_argv(1, killed))
    assert code == 0, err[-3000:]
    assert f"resharding {killed / final} (2 ranks, zero2) for 1 rank under zero2" in out + err
    assert accuracy(out) == expected_accuracy

    code, out, err = run([str(BIN / "hvdtrain"), "checkpoint", "consolidate", str(killed / final)])
    assert code == 0, err
    assert (killed / f"{final}.pt").exists()
    # The full file beside the directory wins at the same step: 1 worker under fsdp resumes from
    # it, has nothing left to train and evaluates the same model.
    code, out, err = run(train_argv(1, killed, strategy="fsdp", checkpoint_format="full"))
    assert code == 0, err[-3000:]
    assert f"resuming from {killed / final}.pt" in out
    assert "resuming a checkpoint of 2 data-parallel workers (2 ranks) on 1: the global batch stays" in out
    assert accuracy(out) == expected_accuracy

    # `hvdtrain export` of the sharded checkpoint writes the consolidated model as safetensors;
    # every run that finished exported the same final model into its run directory.
    code, out, err = run([str(BIN / "hvdtrain"), "export", str(whole / final)])
    assert code == 0, err
    at_end = sorted((tmp_path / "runs").glob("*/model.safetensors"))
    assert at_end, "no run exported its model"
    for path in [whole / f"{final}-export" / "model.safetensors", *at_end]:
        exported = load_file(str(path))
        assert set(exported) == set(expected["model"]), path
        assert all(torch.equal(exported[key], tensor) for key, tensor in expected["model"].items()), path
    code, out, err = run([str(BIN / "hvdtrain"), "export", str(whole / final)])
    assert code == 1 and "exists: choose another --out, or --force" in err

"""A sharded checkpoint resumes at another worker count and under another strategy, resharded on load,
and ends bitwise where the same checkpoint consolidated first ends (train.py in float64).

Two runs write the checkpoints: 4 workers under zero2 and 2 under fsdp, stopped at step STOP. Each
case copies one, consolidates the copy (the full file wins at the same step), and resumes both at
its worker count and strategy to step END; the two exported models must be equal to the bit.
"""
import shutil

import pytest
import torch
from safetensors.torch import load_file

from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.consolidate import consolidate
from tests.launch.helpers import PYTHON, run

STOP, END = 6, 12
# 96 samples per global batch: whole batches per worker at 1, 2, 3 and 4 workers.
GLOBAL_BATCH = 96
WRITTEN = {"zero2-4": ("zero2", 4), "fsdp-2": ("fsdp", 2)}
# End to end through train.py, two cases: fewer workers that do not divide the buckets, and more
# workers under another strategy. Every other pair (4 -> 2, 4 -> 1, to ddp, between zero1, zero2,
# fsdp and the meshes, at 1, 2 and 4 ranks) is checked in one launch against the consolidated state:
# tests/mpi/test_sharded_checkpoint.py and tests/mpi/test_mesh_checkpoint.py.
CASES = {  # name: (checkpoint, strategy, workers)
    "4 zero2 -> 3 zero2": ("zero2-4", "zero2", 3),
    "2 fsdp -> 4 zero1": ("fsdp-2", "zero1", 4),
}


def train_argv(workers, strategy, checkpoint_dir, run_dir, max_steps, batch_size):
    """``batch_size``: the writer's, in both runs (a setting that defines the run); a resumed run keeps
    the checkpoint's global batch, so its workers each take GLOBAL_BATCH / workers samples."""
    checkpoint_format = "full" if strategy == "ddp" else "sharded"
    return ["mpirun", "-np", str(workers), "--oversubscribe", PYTHON, "train.py", "--epochs", "1",
            "--model.dtype=float64", f"--train.batch_size={batch_size}",
            f"--train.strategy={strategy}", f"--train.checkpoint_format={checkpoint_format}",
            "--checkpoint-dir", str(checkpoint_dir), "--checkpoint-every", str(STOP),
            f"--train.max_steps={max_steps}", f"--train.run_dir={run_dir}", "--train.run_name=run"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Each source checkpoint directory, stopped at step STOP."""
    base = tmp_path_factory.mktemp("written")
    directories = {}
    for name, (strategy, workers) in WRITTEN.items():
        code, out, err = run(train_argv(workers, strategy, base / name, base / f"runs-{name}", STOP,
                                        GLOBAL_BATCH // workers), timeout=240)
        assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
        assert (base / name / sharded.directory_name(STOP) / sharded.MANIFEST).exists()
        directories[name] = base / name
    return directories


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(CASES))
def test_resharded_on_load_ends_as_the_consolidated_checkpoint_does(case, written, tmp_path):
    source, strategy, workers = CASES[case]
    models = []
    for path in ("resharded", "consolidated"):
        directory = tmp_path / path
        shutil.copytree(written[source], directory, ignore=shutil.ignore_patterns(".hvdtrain.lock", "owner.json"))
        if path == "consolidated":
            checkpoint = directory / sharded.directory_name(STOP)
            torch.save(consolidate(checkpoint), directory / f"{checkpoint.name}.pt")
        code, out, err = run(train_argv(workers, strategy, directory, tmp_path / f"runs-{path}", END,
                                        GLOBAL_BATCH // WRITTEN[source][1]), timeout=240)
        assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
        if path == "resharded":
            assert f"resharding {directory / sharded.directory_name(STOP)} (" in out + err, (out + err)[-3000:]
        assert f"resumed at epoch 0, step {STOP}" in out + err, (out + err)[-3000:]
        models.append(load_file(str(tmp_path / f"runs-{path}" / "run" / "model.safetensors")))
    resharded, consolidated = models
    assert set(resharded) == set(consolidated)
    assert resharded["features.0.weight"].dtype == torch.float64
    different = [key for key in consolidated if not torch.equal(resharded[key], consolidated[key])]
    assert not different, f"{case}: resharded and consolidated runs differ in {different}"

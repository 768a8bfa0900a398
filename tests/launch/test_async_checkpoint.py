"""train.checkpoint_async: a SIGKILL while the background thread writes a checkpoint leaves the
previous checkpoint the newest valid one (``latest`` still names it), and the next start removes
what the killed write left and resumes from it.

The job's state is about 400 MB per checkpoint (tests/launch/async_save_job.py), so the write it
is killed in lasts long enough to be caught: the test kills as soon as the background thread's
file appears, and fails as "too late" if that checkpoint was complete after all.
"""
import pytest

from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.formats.full import LATEST, CheckpointStore, checkpoint_name
from tests.launch.helpers import PYTHON, kill_when, run

MAX_STEPS, KILLED_AT = 6, 4  # checkpoints every 2 steps: 2 is complete when 4's write is killed


def job(directory, strategy, checkpoint_format):
    return ["mpirun", "-np", "2", "--oversubscribe", PYTHON, "tests/launch/async_save_job.py", str(directory),
            strategy, checkpoint_format, str(MAX_STEPS)]


def writing(directory, checkpoint_format, step):
    """Whether the background thread has begun writing step's checkpoint (its first file exists)."""
    if checkpoint_format == "full":
        return any(directory.glob(f".{checkpoint_name(step)}.tmp-*"))
    # .ckpt-N.tmp-<the lease's token>/: named after the claim of the run that writes it.
    return any((temporary / sharded.shard_name(0, 2)).exists()
               for temporary in directory.glob(f".{sharded.directory_name(step)}.tmp-*"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy,checkpoint_format", [("ddp", "full"), ("zero2", "sharded")])
def test_a_background_write_killed_midway_leaves_the_previous_checkpoint_to_resume(tmp_path, strategy,
                                                                                  checkpoint_format):
    directory = tmp_path / "ckpt"
    kill_when(job(directory, strategy, checkpoint_format), lambda: writing(directory, checkpoint_format, KILLED_AT),
              f"step {KILLED_AT}'s background write", poll=0.002)

    store = CheckpointStore(directory)
    steps = [step for step, _ in store.steps()]
    assert KILLED_AT not in steps, f"the kill came too late: step {KILLED_AT}'s checkpoint was complete"
    path, _ = store.read_newest_valid()
    assert path.name.startswith(sharded.directory_name(KILLED_AT - 2)), f"newest valid: {path.name}"
    assert (directory / LATEST).read_text().strip() == path.name

    code, out, err = run(job(directory, strategy, checkpoint_format))
    assert code == 0, err[-3000:]
    assert f"resuming from {path}" in out + err and f"trained to step {MAX_STEPS}" in out, (out + err)[-3000:]
    assert "that killed saves left" in out + err, "the killed write's temporary file was not removed"
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".ckpt")]
    assert not leftovers, leftovers
    assert [step for step, _ in store.steps()][0] == MAX_STEPS  # the end of the run waited for its write

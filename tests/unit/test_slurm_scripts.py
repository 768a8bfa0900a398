"""Every slurm/ script asks for the preemption warning and for requeueing, and passes the warning on;
the GPU script asks for GPUs and cores per rank the way hvdtrain's pinning expects."""
import re
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "slurm").glob("*.sbatch"))


def directives(text):
    return [line.split("#", 2)[1].split(None, 1)[1].split()[0] for line in text.splitlines()
            if line.startswith("#SBATCH ")]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_each_script_asks_for_the_warning_and_requeueing(script):
    text = script.read_text()
    options = directives(text)
    assert "--requeue" in options, script
    signal_options = [option for option in options if option.startswith("--signal=")]
    assert len(signal_options) == 1 and re.fullmatch(r"--signal=(B:)?USR1@\d+", signal_options[0]), options
    if signal_options[0].startswith("--signal=B:"):
        # Sent to the batch shell only: the script must hand it to its launcher, or no rank sees it.
        assert re.search(r"^trap '.*-USR1 .*\$launcher.*' USR1$", text, re.MULTILINE), script


def test_the_three_launch_paths_the_gpu_script_and_the_lm_recipes_are_there():
    assert [path.name for path in SCRIPTS] == ["lm_recipe.sbatch", "train-gpu.sbatch", "train-horovodrun.sbatch",
                                               "train-mpirun.sbatch", "train.sbatch"]


def values(text, commented=False):
    """{option: value} of the #SBATCH lines (or of the commented-out ##SBATCH alternatives)."""
    prefix = "##SBATCH " if commented else "#SBATCH "
    found = {}
    for line in text.splitlines():
        if line.startswith(prefix):
            option = line[len(prefix):].split("#", 1)[0].split()[0]
            name, _, value = option.partition("=")
            found[name] = value
    return found


def test_the_gpu_script_gives_each_rank_one_gpu_and_its_cores():
    text = (SCRIPTS[0].parent / "train-gpu.sbatch").read_text()
    active = values(text)
    # One visible GPU per task: hvdtrain computes on cuda:0, that task's own GPU (devices.choose_device).
    assert active["--gpus-per-task"] == "1"
    assert not {"--gres", "--gpus", "--gpus-per-node"} & set(active), "a second GPU request contradicts the first"
    assert int(active["--ntasks-per-node"]) >= 1 and int(active["--cpus-per-task"]) >= 1
    # srun (SLURM >= 22.05) takes --cpus-per-task from SRUN_CPUS_PER_TASK, not from sbatch's.
    assert re.search(r"^export SRUN_CPUS_PER_TASK=\$\{SLURM_CPUS_PER_TASK", text, re.MULTILINE)
    assert re.search(r"^srun --mpi=pmix ", text, re.MULTILINE)
    # The documented alternative: every GPU of the node to every task, as many as its tasks (cuda:<local rank>).
    alternative = values(text, commented=True)
    assert alternative["--gres"] == f"gpu:{active['--ntasks-per-node']}" and alternative["--gpu-bind"] == "none"
    # Every line a site must adapt says so.
    for option in ("--ntasks-per-node", "--cpus-per-task", "--partition", "--gres"):
        line = next(line for line in text.splitlines() if f"SBATCH {option}" in line)
        assert "# SITE:" in line, line


def test_every_srun_ends_the_step_when_a_rank_dies():
    """Without --kill-on-bad-exit, the ranks left wait in a collective for the dead one until the time limit."""
    launches = [(path.name, line) for path in sorted(SCRIPTS[0].parent.glob("*.sbatch"))
                for line in path.read_text().splitlines() if line.startswith("srun ")]
    assert len(launches) >= 2, launches
    for name, line in launches:
        assert "--kill-on-bad-exit=1" in line.split(), f"{name}: {line}"

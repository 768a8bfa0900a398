"""Every slurm/ script asks for the preemption warning and for requeueing, and passes the warning on."""
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


def test_the_three_launch_paths_are_there():
    assert [path.name for path in SCRIPTS] == ["train-horovodrun.sbatch", "train-mpirun.sbatch", "train.sbatch"]

"""Refusals (hvdtrain.HvdtrainError) end a process with one line on rank 0 and exit status 2; every
refusal type is one, and still the type callers caught before."""
import subprocess
import sys

import pytest

import hvdtrain
from hvdtrain.checkpoint import CheckpointError
from hvdtrain.common.errors import HvdtrainError, LayoutError, MissingPath
from hvdtrain.config.loader import ConfigError
from hvdtrain.distributed.environments.base import LauncherEnvironmentError
from hvdtrain.distributed.environments.nodelist import NodelistError
from hvdtrain.launch.hostfile import HostfileError
from hvdtrain.planner.plan import NothingFits
from hvdtrain.verify.driver import LaunchFailed


@pytest.mark.parametrize("kind, base", [(ConfigError, ValueError), (CheckpointError, RuntimeError),
                                        (HostfileError, ValueError), (NothingFits, ValueError),
                                        (LaunchFailed, RuntimeError), (NodelistError, ValueError),
                                        (LauncherEnvironmentError, RuntimeError), (LayoutError, ValueError),
                                        (MissingPath, FileNotFoundError)])
def test_every_refusal_is_an_hvdtrain_error_and_keeps_its_base(kind, base):
    assert issubclass(kind, HvdtrainError) and issubclass(kind, base)
    assert hvdtrain.HvdtrainError is HvdtrainError


def ends(code, env=None):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


RAISES = ("import signal\n"
          "from hvdtrain.common.errors import install_refusal_hook\n"
          "from hvdtrain.checkpoint import CheckpointError\n"
          "signal.signal(signal.SIGTERM, lambda *_: print('noted', flush=True))  # as a preemption handler\n"
          "{meeting}install_refusal_hook(is_root={root}, grace_seconds={grace}{meet})\n"
          "print('before', flush=True)\n"
          "raise CheckpointError('checkpoint_dir x holds checkpoints already\\nand resume=false')\n")


def test_a_refusal_is_one_line_on_rank_zero_and_exit_status_two():
    root = ends(RAISES.format(root=True, grace=60, meeting="", meet=""))
    assert (root.returncode, root.stderr, root.stdout) == (
        2, "hvdtrain: checkpoint_dir x holds checkpoints already and resume=false\n", "before\n")


MEETING = "def meet(seconds):\n    print(f'met within {{seconds}} s', flush=True)\n    return {met}\n"


def test_every_rank_meets_the_others_before_it_exits_rank_zero_once_its_line_is_out():
    # A launcher ends the job at the first non-zero exit: had rank 1 exited at once, rank 0's line
    # could be lost (CI saw mpirun abort rank 0 before it printed). So no rank exits before the meeting.
    root = ends(RAISES.format(root=True, grace=7, meeting=MEETING.format(met=True), meet=", meet=meet"))
    assert (root.returncode, root.stdout) == (2, "before\nmet within 7 s\n")
    assert root.stderr == "hvdtrain: checkpoint_dir x holds checkpoints already and resume=false\n"
    other = ends(RAISES.format(root=False, grace=7, meeting=MEETING.format(met=True), meet=", meet=meet"))
    assert (other.returncode, other.stdout, other.stderr) == (2, "before\nmet within 7 s\n", "")


def test_a_rank_that_meets_nobody_speaks_for_itself():
    # Rank 0 did not refuse (or nothing to meet with): the reason is never lost.
    import os
    for meeting, meet in ((MEETING.format(met=False), ", meet=meet"), ("", "")):
        other = ends(RAISES.format(root=False, grace=0.5, meeting=meeting, meet=meet),
                     env=dict(os.environ, OMPI_COMM_WORLD_RANK="1"))
        assert (other.returncode, other.stderr) == (2, "hvdtrain: (rank 1; rank 0 did not say it) checkpoint_dir "
                                                       "x holds checkpoints already and resume=false\n")


def test_a_waiting_rank_ends_at_the_launchers_sigterm_whatever_handler_it_had():
    import signal
    waiting = subprocess.Popen([sys.executable, "-c", RAISES.format(root=False, grace=600, meeting="", meet="")], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert waiting.stdout.readline() == "before\n"
        # The hook runs just after 'before'; a SIGTERM sent earlier would meet the script's own handler.
        deadline = 100
        while deadline and waiting.poll() is None:
            waiting.send_signal(signal.SIGTERM)
            try:
                waiting.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                deadline -= 1
        assert waiting.returncode == -signal.SIGTERM, waiting.returncode  # not after the 600 s grace
        assert waiting.stderr.read() == ""
    finally:
        waiting.kill()
        waiting.wait()


def test_any_other_error_keeps_its_traceback():
    done = ends("from hvdtrain.common.errors import install_refusal_hook\n"
                "install_refusal_hook(is_root=True)\nraise KeyError('x')\n")
    assert done.returncode == 1 and "Traceback" in done.stderr and "KeyError: 'x'" in done.stderr


def test_hvdtrain_traceback_shows_a_refusals_traceback(monkeypatch):
    import os
    done = ends(RAISES.format(root=True, grace=60, meeting="", meet=""), env=dict(os.environ, HVDTRAIN_TRACEBACK="1"))
    assert done.returncode == 2 and "Traceback" in done.stderr and "CheckpointError" in done.stderr


def test_the_command_prints_a_refusal_it_did_not_catch_as_one_line(monkeypatch, capsys):
    from hvdtrain import cli
    from hvdtrain.cli import info

    def refuses(args):
        raise NothingFits("no layout fits 2 GiB per worker: give each worker 4 GiB")
    monkeypatch.setattr(info, "run", refuses)
    assert cli.main(["info"]) == 2
    assert capsys.readouterr().err == "hvdtrain: no layout fits 2 GiB per worker: give each worker 4 GiB\n"


def test_a_missing_pretrained_directory_is_a_refusal_and_still_a_file_not_found(tmp_path):
    pytest.importorskip("transformers")
    from hvdtrain.examples.hf_lm import HFLMModelConfig, model_config

    with pytest.raises(MissingPath, match=f"model.pretrained={tmp_path / 'absent'} has no config.json") as refused:
        model_config(HFLMModelConfig(pretrained=str(tmp_path / "absent")), 40)
    assert isinstance(refused.value, FileNotFoundError)

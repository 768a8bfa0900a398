import signal

import pytest

from hvdtrain.config.train import TrainConfig
from hvdtrain.fault_tolerance.preemption import PreemptionFlag, requeue_command


def test_requeue_only_inside_a_slurm_job_with_scontrol(monkeypatch, tmp_path):
    scontrol = tmp_path / "scontrol"
    scontrol.write_text("#!/bin/sh\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert requeue_command({"SLURM_JOB_ID": "42"}) == ["scontrol", "requeue", "42"]
    assert requeue_command({}) is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert requeue_command({"SLURM_JOB_ID": "42"}) is None


def test_the_signal_only_sets_a_flag(monkeypatch):
    previous = signal.getsignal(signal.SIGUSR2)
    try:
        flag = PreemptionFlag("usr2")
        assert not flag._requested
        signal.raise_signal(signal.SIGUSR2)
        assert flag._requested
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_an_unknown_signal_name_is_refused():
    with pytest.raises(ValueError, match="unknown signal 'USR9'"):
        PreemptionFlag("USR9")


def test_preempt_on_term_makes_term_set_the_flag_too():
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    try:
        flag = PreemptionFlag("USR1", on_term=True)
        signal.raise_signal(signal.SIGTERM)  # without the handler, TERM would end this test's process
        assert flag._requested
        alone = PreemptionFlag("", on_term=True)
        signal.raise_signal(signal.SIGTERM)
        assert alone._requested
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_term_keeps_its_handler_unless_asked():
    previous = signal.getsignal(signal.SIGTERM)
    try:
        PreemptionFlag("USR1")
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


@pytest.mark.parametrize("name, why", [("KILL", "cannot be caught"), ("SIGSTOP", "cannot be caught"),
                                       ("CHLD", "the system sends it for other reasons"),
                                       ("WINCH", "the system sends it for other reasons"), ("USR9", "no such signal")])
def test_preempt_signal_is_refused_unless_it_can_be_caught_and_means_preemption(name, why):
    with pytest.raises(ValueError, match=f"preempt_signal must be one of USR1, USR2, TERM, INT, HUP, or '' .*{why}"):
        TrainConfig(preempt_signal=name)


@pytest.mark.parametrize("given, kept", [("USR1", "USR1"), ("sigusr2", "USR2"), ("term", "TERM"), ("", "")])
def test_preempt_signal_takes_any_spelling_of_the_allowed_names(given, kept):
    assert TrainConfig(preempt_signal=given).preempt_signal == kept


def test_a_negative_seed_is_refused_naming_why():
    with pytest.raises(ValueError, match=r"TrainConfig.seed must be a whole number >= 0 .*got -1"):
        TrainConfig(seed=-1)
    assert TrainConfig(seed=0).seed == 0

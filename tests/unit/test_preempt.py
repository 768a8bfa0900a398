import signal

import pytest

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

"""The start-up clock: phases from the process's start, each taken once, reported once."""
import time

import pytest

from hvdtrain.common.startup_clock import StartupClock, process_start_time


def test_the_phases_split_the_time_from_the_process_start_and_each_mark_counts_once():
    clock = StartupClock(started_at=time.time() - 5.0)
    clock.mark("imports")
    clock.mark("horovod init")
    first = dict(clock.marks)
    time.sleep(0.01)
    clock.mark("imports")  # a second hvdtrain.init(): the first mark stays
    clock.mark("set-up")
    clock.mark("first step")
    assert clock.marks["imports"] == first["imports"] and clock.marks["imports"] >= 5.0
    durations = clock.durations()
    assert list(durations) == ["imports", "horovod init", "set-up", "first step"]
    assert durations["imports"] == clock.marks["imports"] and min(durations.values()) >= 0
    assert sum(durations.values()) == pytest.approx(clock.total())


def test_the_report_comes_once_after_the_first_step():
    clock = StartupClock(started_at=time.time() - 1.0)
    clock.mark("imports")
    clock.mark("set-up")
    assert clock.take_report() is None  # no first step yet
    clock.mark("first step")  # a Trainer given its world without hvdtrain.init(): no Horovod phase
    report = clock.take_report()
    assert set(report) == {"total_s", "imports_s", "set_up_s", "first_step_s"}  # the record's keys: no hyphen
    assert report["imports_s"] + report["set_up_s"] + report["first_step_s"] == pytest.approx(report["total_s"])
    assert clock.take_report() is None
    assert clock.line().startswith(f"start-up: {report['total_s']:.1f} s from the process's start")


def test_an_unknown_phase_is_refused_and_the_process_start_is_in_the_past():
    with pytest.raises(ValueError, match="one of imports, horovod init, set-up, first step"):
        StartupClock(started_at=0.0).mark("compile")
    assert 0 < time.time() - process_start_time() < 3600

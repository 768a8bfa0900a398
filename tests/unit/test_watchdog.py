"""The stall watchdog: a rank without a step for `timeout` seconds ends the job; a save does not, unless
its file stops moving for `io_timeout` seconds."""
import io
import threading
import time

import torch

from hvdtrain.common import io_watch
from hvdtrain.common.atomic import write_atomically
from hvdtrain.fault_tolerance.watchdog import STALL_EXIT_CODE, StallWatchdog

TIMEOUT = 0.3  # seconds; the watchdog checks every 0.1 s (its shortest interval)


def watchdog(pending=lambda: []):
    exits = []
    fired = threading.Event()

    def exit_process(code):
        exits.append(code)
        fired.set()
    return StallWatchdog(TIMEOUT, 0, "hostA", pending, exit_process=exit_process), exits, fired


def test_a_rank_without_steps_ends_the_job(capsys):
    dog, exits, fired = watchdog()
    dog.start()
    assert fired.wait(10)
    assert exits == [STALL_EXIT_CODE]
    assert "THIS rank stopped calling them" in capsys.readouterr().err


def test_a_long_save_is_not_a_stall_and_the_clock_restarts_after_it():
    dog, exits, fired = watchdog()
    dog.start()
    with dog.paused():
        time.sleep(4 * TIMEOUT)
    assert not fired.wait(TIMEOUT / 2) and exits == []
    dog.stop()


def test_set_up_is_guarded_and_named(capsys):
    dog, exits, fired = watchdog(pending=None)
    dog.phase = "set-up"
    dog.start()
    assert fired.wait(10)
    assert "nothing finished for" in capsys.readouterr().err


# Checkpoint I/O: each file in flight has its own clock (train.checkpoint_timeout), in any thread.

IO_TIMEOUT = 1.0  # seconds; the live writers below move a block every 0.05 s


def io_watchdog(timeout=TIMEOUT):
    exits = []
    fired = threading.Event()

    def exit_process(code):
        exits.append(code)
        fired.set()
    dog = StallWatchdog(timeout, 1, "hostB", lambda: [], exit_process=exit_process, io_timeout=IO_TIMEOUT)
    return dog, exits, fired


def beat_steps_until(dog, done):
    """The training thread: steps keep finishing (a background save runs beside them)."""
    step = 0
    while not done.wait(0.05):
        step += 1
        dog.beat(step)


def test_a_slow_save_whose_bytes_keep_moving_is_never_ended(tmp_path):
    """A save inside paused() (every rank saves) writing a block every 0.05 s for 2.5 IO_TIMEOUTs."""
    dog, exits, fired = io_watchdog()
    dog.start()
    with dog.paused(), io_watch.watching(tmp_path / "ckpt-000000001.pt", "write") as activity:
        handle = activity.counting(io.BytesIO())
        deadline = time.monotonic() + 2.5 * IO_TIMEOUT
        while time.monotonic() < deadline:
            handle.write(b"x" * 4096)
            time.sleep(0.05)
    assert not fired.wait(TIMEOUT) and exits == []
    assert activity.bytes == len(handle.getvalue()) > 0
    dog.stop()


def test_a_background_write_that_stops_is_reported_with_its_file_and_bytes_while_steps_go_on(tmp_path, capsys):
    """The writer thread moves 1234 bytes and hangs (a hung mount); the training thread keeps
    beating by steps: the I/O watch, not the step clock, ends the process, naming file and bytes."""
    dog, exits, fired = io_watchdog()
    path = tmp_path / "rank-00001-of-00002.pt"
    release, steps_done = threading.Event(), threading.Event()

    def write():
        with open(path, "wb") as raw, io_watch.watching(path, "write") as activity:
            activity.counting(raw).write(b"x" * 1234)
            release.wait(60)
    writer = threading.Thread(target=write, name="hvdtrain-checkpoint-writer")
    dog.start()
    writer.start()
    stepping = threading.Thread(target=beat_steps_until, args=(dog, steps_done))
    stepping.start()
    try:
        assert fired.wait(30)
    finally:
        steps_done.set()
        release.set()
        writer.join()
        stepping.join()
    err = capsys.readouterr().err
    assert exits == [STALL_EXIT_CODE]
    assert f"STALL rank 1 on hostB: the checkpoint write of {path} moved no byte for" in err, err
    assert "1234 bytes written so far" in err and "hvdtrain-checkpoint-writer" in err
    assert "checkpoint_timeout=1 s" in err


def test_a_read_that_never_ends_is_reported_with_its_file(tmp_path, capsys):
    dog, exits, fired = io_watchdog()
    dog.start()
    with dog.paused(), io_watch.watching(tmp_path / "model.safetensors", "read"):
        assert fired.wait(30)
    assert exits == [STALL_EXIT_CODE]
    err = capsys.readouterr().err
    assert f"the checkpoint read of {tmp_path / 'model.safetensors'} has not ended after" in err, err


def test_an_atomic_torch_save_counts_every_byte_of_its_file(tmp_path):
    """write_atomically's handle counts what torch.save writes through it, under the final path."""
    seen = []
    path = tmp_path / "ckpt-000000001.pt"

    def save(handle):
        torch.save({"w": torch.arange(1000)}, handle)
        seen.extend(io_watch.active())
    write_atomically(path, save)
    assert [activity.path for activity in seen] == [str(path)]
    assert seen[0].bytes == path.stat().st_size > 8000
    assert io_watch.active() == []
    assert torch.equal(torch.load(path)["w"], torch.arange(1000))


# The report goes out even when the run directory (where the flight record goes) hangs.

class HungFlightRecord:
    """A flight recorder whose dump never returns, as on a run directory whose mount hangs (its
    mkdir blocks); ``events`` shares the order of what happened with the stderr lines."""

    def __init__(self, events):
        self.events, self.release = events, threading.Event()

    def in_flight(self):
        return []

    def on_stall(self):
        self.events.append(("dump begins", time.monotonic()))
        self.release.wait(120)
        return ""  # released when the test ends: nothing more to say

    def verdict(self, within):
        return ""


class Lines(io.StringIO):
    """stderr, each write noted in ``events`` with its time."""

    def __init__(self, events):
        super().__init__()
        self.events = events

    def write(self, text):
        if text.strip():
            self.events.append((text.strip(), time.monotonic()))
        return super().write(text)


def join_stall_records():
    """The stall record's thread, released at a test's end, ends before the next test (its prints)."""
    for thread in threading.enumerate():
        if thread.name == "hvdtrain-stall-record":
            thread.join(10)


def test_the_stall_line_goes_first_and_the_job_ends_while_the_flight_record_hangs(monkeypatch):
    from hvdtrain.fault_tolerance import watchdog as watchdog_module

    monkeypatch.setattr(watchdog_module, "FLIGHT_DUMP_SECONDS", 1.0, raising=False)
    events = []
    monkeypatch.setattr("sys.stderr", Lines(events))
    dog, exits, fired = watchdog()
    dog.flight = HungFlightRecord(events)
    dog.start()
    try:
        assert fired.wait(30), f"the watchdog never ended the job: {events}"
        ended = time.monotonic()
    finally:
        dog.flight.release.set()
        join_stall_records()
    assert exits == [STALL_EXIT_CODE]
    said = [what for what, _ in events]
    assert said[0].startswith("[hvdtrain] STALL rank 0 on hostA: no step finished") and said[1] == "dump begins", said
    assert "flight record not written in 3 s" in said[2], said  # FLIGHT_DUMP_SECONDS + one 0.1 s interval + 2 s
    # The exit came right after the bound (1 s + the 2.1 s grace), not after a second grace nor never.
    stall_at = events[0][1]
    assert 3.0 <= ended - stall_at < 3.1 + 1.5, ended - stall_at

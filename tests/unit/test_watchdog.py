"""The stall watchdog: a rank without a step for `timeout` seconds ends the job; a save does not."""
import threading
import time

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

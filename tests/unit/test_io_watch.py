"""Storage work in flight, as the stall watchdog sees it: nested activities, progress that keeps
every enclosing clock alive, and the report naming the innermost work stuck."""
import threading
import time

from hvdtrain.common import io_watch
from hvdtrain.fault_tolerance.watchdog import StallWatchdog


def watchdog(io_timeout):
    return StallWatchdog(0, rank=0, host="here", pending=None, exit_process=lambda code: None, io_timeout=io_timeout)


def test_progress_inside_keeps_every_enclosing_activity_alive(tmp_path):
    with io_watch.watching(tmp_path, "checkpoint save") as save:
        with io_watch.watching(tmp_path / "ckpt.pt", "write") as write:
            before = save.last_progress
            time.sleep(0.01)
            write.progress(100)
            assert save.last_progress > before and save.bytes == write.bytes == 100
        assert io_watch.current() is save
        time.sleep(0.01)
        io_watch.progress()  # a storage call of this thread returned
        assert save.last_progress > write.last_progress
    assert io_watch.current() is None and io_watch.active() == []


def test_progress_outside_any_activity_is_nothing():
    io_watch.progress(10)
    assert io_watch.active() == []


def test_the_innermost_work_stuck_is_named(tmp_path):
    """A save whose lease renewal hangs: both are silent; the report names the renewal."""
    dog = watchdog(io_timeout=0.05)
    with io_watch.watching(tmp_path, "checkpoint save of step 4"):
        with io_watch.watching(tmp_path / "owner.json", "lease renewal"):
            time.sleep(0.1)
            now = time.monotonic()
            stuck = dog.stalled_io(now)
            message = dog.io_report(stuck, now)
    assert stuck.kind == "lease renewal"
    assert f"the lease renewal of {tmp_path / 'owner.json'} is stuck in a storage call: none returned for " in message
    assert "checkpoint_timeout=0.05 s" in message


def test_each_thread_nests_its_own_activities(tmp_path):
    """The lease's renewal thread and the writer thread each have their own: neither is the other's parent."""
    seen = {}

    def renew():
        with io_watch.watching(tmp_path / "owner.json", "lease renewal") as renewal:
            seen["parent"] = renewal.parent
    with io_watch.watching(tmp_path, "checkpoint save"):
        thread = threading.Thread(target=renew)
        thread.start()
        thread.join()
    assert seen["parent"] is None


def test_a_slow_save_whose_calls_return_is_not_a_stall(tmp_path):
    dog = watchdog(io_timeout=0.2)
    with io_watch.watching(tmp_path, "checkpoint save"):
        for _ in range(6):  # 0.3 s in all, each call returning within the timeout
            time.sleep(0.05)
            io_watch.progress()
            assert dog.stalled_io(time.monotonic()) is None

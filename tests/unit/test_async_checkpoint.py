"""The parts of an asynchronous save: the host copy the step waits for, the background write, and
the records through which a sharded save's ranks tell rank 0 their files are written."""
import threading
import time

import pytest
import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.async_writing.background import BackgroundWrite
from hvdtrain.checkpoint.async_writing.snapshot import HostSnapshot


def live_state():
    tied = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    return {"model": {"embedding": tied, "head": tied, "bias": torch.ones(3)},
            "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.full((2, 3), 0.5)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "rng": [torch.ByteTensor([1, 2, 3])], "epoch": 2, "pair": (torch.zeros(2), "name")}


def test_the_copy_keeps_the_values_of_its_moment_while_training_changes_the_live_tensors():
    state = live_state()
    copied = HostSnapshot().copy(state)
    expected = {"bias": state["model"]["bias"].clone(), "exp_avg": state["optimizer"]["state"][0]["exp_avg"].clone()}
    state["model"]["bias"].add_(1.0)  # the next steps, in place, as optimizers do
    state["optimizer"]["state"][0]["exp_avg"].mul_(3.0)
    assert torch.equal(copied["model"]["bias"], expected["bias"])
    assert torch.equal(copied["optimizer"]["state"][0]["exp_avg"], expected["exp_avg"])
    assert copied["epoch"] == 2 and copied["pair"][1] == "name" and copied["optimizer"]["param_groups"][0]["lr"] == 0.1
    assert copied["model"]["head"] is copied["model"]["embedding"], "tied weights must stay one tensor (written once)"


def test_the_next_copy_reuses_the_buffers_and_a_new_shape_gets_its_own():
    snapshot = HostSnapshot()
    state = live_state()
    first = snapshot.copy(state)
    pointers = [first["model"]["bias"].data_ptr(), first["optimizer"]["state"][0]["exp_avg"].data_ptr()]
    state["model"]["bias"].fill_(7.0)
    second = snapshot.copy(state)
    assert [second["model"]["bias"].data_ptr(), second["optimizer"]["state"][0]["exp_avg"].data_ptr()] == pointers
    assert torch.equal(second["model"]["bias"], torch.full((3,), 7.0))
    held = snapshot.bytes
    state["model"]["bias"] = torch.ones(5)
    third = snapshot.copy(state)
    assert third["model"]["bias"].shape == (5,) and snapshot.bytes == held + 2 * 4


def test_a_write_runs_in_the_background_and_its_failure_is_reported_when_waited_for():
    writer, release = BackgroundWrite(), threading.Event()
    writer.start(lambda: release.wait(10))
    assert writer.in_flight
    with pytest.raises(RuntimeError, match="still in flight"):
        writer.start(lambda: None)
    release.set()
    assert writer.wait() is None and not writer.in_flight

    def full_disk():
        raise OSError(28, "No space left on device")
    writer.start(full_disk)
    assert "No space left on device" in writer.wait()
    assert writer.wait() is None  # nothing in flight: nothing to report


def test_rank_zero_waits_for_every_rank_s_record_and_publishes_them_in_rank_order(tmp_path):
    records = [{"name": sharded.shard_name(rank, 3), "rank": rank, "bytes": 10 + rank, "sha256": "ab"}
               for rank in range(3)]

    def others_write_later():
        time.sleep(0.2)
        for rank in (2, 1):
            sharded.write_record(tmp_path, rank, records[rank])
    thread = threading.Thread(target=others_write_later)
    thread.start()
    sharded.write_record(tmp_path, 0, records[0])
    assert sharded.wait_for_records(tmp_path, 3, timeout=30) == records
    thread.join()
    assert list(tmp_path.iterdir()) == [], "the records go before the directory is published"


def test_a_rank_s_failure_or_silence_is_named(tmp_path):
    sharded.write_record(tmp_path, 0, {"name": sharded.shard_name(0, 3), "rank": 0, "bytes": 1, "sha256": "ab"})
    sharded.write_record(tmp_path, 2, "OSError: [Errno 28] No space left on device")
    with pytest.raises(CheckpointError, match=r"rank 2: OSError: \[Errno 28\] No space left on device"):
        sharded.wait_for_records(tmp_path, 3, timeout=30)
    (tmp_path / sharded.record_name(2)).unlink()
    with pytest.raises(CheckpointError, match=r"no word from rank\(s\) \[1, 2\].*not one directory shared"):
        sharded.wait_for_records(tmp_path, 3, timeout=0.1)
    with pytest.raises(CheckpointError, match="the run ended"):
        sharded.wait_for_records(tmp_path, 3, timeout=30, stop=lambda: True)

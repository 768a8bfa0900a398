"""The flight recorder: its ring buffers, the dumps (on request, on SIGUSR2, on a stall) and the
analysis of constructed dumps: a skipped collective, another order, another shape, a slow rank."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from hvdtrain.common.flight import analysis
from hvdtrain.common.flight.dumps import DumpService, alive_ranks, request_dump, write_dump
from hvdtrain.common.flight.recorder import FlightRecorder
from hvdtrain.fault_tolerance.watchdog import StallWatchdog
from tests.unit.test_watchdog import join_stall_records

T0 = 1_000_000.0


def entry(seq, name, shape=(4,), op="allreduce", start=None, end=True, process_set=0, dtype="float32"):
    start = T0 + seq if start is None else start
    return {"seq": seq, "op": op, "name": name, "shape": list(shape), "dtype": dtype, "process_set": process_set,
            "start": start, "end": start + 0.01 if end else None}


def dump(rank, collectives, phases=(), size=2, written=T0 + 1000):
    return {"format": "hvdtrain-flight/1", "rank": rank, "size": size, "written": written,
            "collectives": list(collectives), "phases": list(phases), "process_sets": {"0": None}}


def common(n):
    return [entry(i, f"grad.{i}") for i in range(n)]


def test_the_recorder_keeps_the_last_entries_with_sequence_numbers_and_ends():
    recorder = FlightRecorder(capacity=3, clock=iter(range(100)).__next__)
    entries = [recorder.start("allreduce", f"x{i}", (2, 3), "float32", 0) for i in range(5)]
    recorder.end(entries[4])
    other = recorder.start("broadcast", "y", (1,), "int32", 7)
    snapshot = json.loads(json.dumps(recorder.snapshot(lambda key: [0, 1] if key == 7 else None)))
    assert [(e["seq"], e["name"], e["end"] is not None) for e in snapshot["collectives"]] == [
        (3, "x3", False), (4, "x4", True), (0, "y", False)]
    assert snapshot["collectives"][0]["shape"] == [2, 3] and other[0] == 0
    assert snapshot["process_sets"] == {"0": None, "7": [0, 1]}
    recorder.resize(0)
    assert not recorder.enabled and list(recorder.collectives) == []
    with pytest.raises(ValueError, match="whole number >= 0"):
        recorder.resize(-1)


def test_a_rank_that_never_entered_a_collective_is_named():
    rank0 = dump(0, common(5) + [entry(5, "preempt.vote", (2,), end=False)])
    rank1 = dump(1, common(5), phases=[{"phase": "data loading", "step": 4, "start": T0 + 990, "end": None}])
    found = analysis.analyze([rank0, rank1])
    assert found.divergence.kind == "missing" and list(found.divergence.odd) == [1] and found.divergence.seq == 5
    verdict = found.verdict()
    assert ("rank 1 never entered allreduce 'preempt.vote' (seq 5 of the global process set), which rank 0 entered"
            in verdict)
    assert "rank 1 was in data loading after step 4 for 10 s" in verdict


def test_another_order_is_named_and_a_skipped_one_said_never_entered():
    rank0 = dump(0, common(3) + [entry(3, "flight.extra", (1,), end=False)])
    rank1 = dump(1, common(3) + [entry(3, "grad.3", end=False), entry(4, "grad.4", end=False)])
    verdict = analysis.analyze([rank0, rank1]).verdict()
    assert ("rank 1 entered allreduce 'grad.3' where rank 0 entered allreduce 'flight.extra' "
            "(seq 3 of the global process set); it never entered 'flight.extra'") in verdict
    # The other order, found later: said so.
    rank1 = dump(1, common(3) + [entry(3, "grad.3"), entry(4, "flight.extra", (1,), end=False)])
    rank0 = dump(0, common(3) + [entry(3, "flight.extra", (1,), end=False)])
    assert "it entered 'flight.extra' later, at seq 4" in analysis.analyze([rank0, rank1]).verdict()


def test_the_majority_is_expected_and_the_odd_rank_named():
    dumps = [dump(r, common(2) + [entry(2, "x" if r != 2 else "y", end=False)], size=3) for r in range(3)]
    divergence = analysis.analyze(dumps).divergence
    assert divergence.kind == "order" and list(divergence.odd) == [2] and divergence.expected_ranks == [0, 1]


def test_another_shape_or_dtype_is_named_but_an_allgathers_rows_may_differ():
    rank0 = dump(0, common(2) + [entry(2, "w", (4, 8), end=False)])
    rank1 = dump(1, common(2) + [entry(2, "w", (4, 9), end=False)])
    verdict = analysis.analyze([rank0, rank1]).verdict()
    assert "rank 1 entered allreduce 'w' of shape [4, 9] float32 where rank 0 entered allreduce 'w' of shape [4, 8]" \
        in verdict
    rank1 = dump(1, common(2) + [entry(2, "w", (4, 8), dtype="float16", end=False)])
    assert analysis.analyze([rank0, rank1]).divergence.kind == "shape"
    gathers = [dump(r, [entry(0, "rows", (r + 1, 8), op="allgather")]) for r in range(2)]
    assert analysis.analyze(gathers).divergence is None


def test_operations_that_completed_in_another_order_and_a_dump_taken_earlier_are_no_divergence():
    # Horovod matches asynchronous operations by name: a completed reorder is fine.
    rank0 = dump(0, [entry(0, "a"), entry(1, "b")])
    rank1 = dump(1, [entry(0, "b"), entry(1, "a")])
    assert analysis.analyze([rank0, rank1]).divergence is None
    # Rank 1 dumped before rank 0 started seq 2: not missing it.
    rank0 = dump(0, common(2) + [entry(2, "late", start=T0 + 500, end=False)])
    rank1 = dump(1, common(2), written=T0 + 400)
    found = analysis.analyze([rank0, rank1])
    assert found.divergence is None and found.verdict().startswith("no divergence")


def phases(name, seconds, steps=range(10)):
    return [{"phase": name, "step": s, "start": T0 + s, "end": T0 + s + seconds} for s in steps]


def test_the_slowest_rank_per_phase_is_a_straggler_against_the_others_median():
    dumps = [dump(r, common(3), phases=phases("data loading", 0.14 if r == 3 else 0.1)
                  + phases("forward and backward", 0.5), size=4) for r in range(4)]
    found = analysis.analyze(dumps)
    slow = found.stragglers[0]
    assert (slow.phase, slow.rank, slow.steps) == ("data loading", 3, 10)
    assert slow.ratio == pytest.approx(1.4)
    assert "straggler: rank 3's data loading is 1.40x the median of the others (1.4 s vs 1 s over 10 steps)" \
        in found.verdict()


def test_a_dump_of_another_format_or_none_at_all_is_refused_clearly(tmp_path):
    with pytest.raises(analysis.DumpError, match="no flight records"):
        analysis.load_dumps(tmp_path)
    (tmp_path / "flight").mkdir()
    (tmp_path / "flight" / "rank-00000.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(analysis.DumpError, match="dump again with this hvdtrain"):
        analysis.load_dumps(tmp_path)


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


def service(tmp_path, recorder, signal_name=""):
    flight = tmp_path / "flight"
    return DumpService(flight, 0, 1, signal_name,
                       lambda reason, extra: write_dump(flight, 0, 1, reason, recorder, extra=extra))


def test_a_request_file_and_sigusr2_make_a_rank_dump_with_its_stacks(tmp_path):
    recorder = FlightRecorder(8)
    recorder.start("allreduce", "stuck", (3,), "float32", 0)
    request_dump(tmp_path)  # an older request is not answered
    dumps = service(tmp_path, recorder, "USR2").start()
    try:
        assert list(alive_ranks(tmp_path / "flight")) == [0]
        path = tmp_path / "flight" / "rank-00000.json"
        token = request_dump(tmp_path)
        wait_for(lambda: path.exists() and json.loads(path.read_text()).get("request") == token)
        record = json.loads(path.read_text())
        assert record["collectives"][0]["name"] == "stuck" and record["reason"] == "hvdtrain debug dump"
        assert any("test_a_request_file_and_sigusr2" in "".join(stack) for stack in record["stacks"].values())
        path.unlink()
        os.kill(os.getpid(), signal.SIGUSR2)
        wait_for(path.exists)
        assert json.loads(path.read_text())["reason"] == "SIGUSR2"
    finally:
        dumps.stop()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # given back
    assert alive_ranks(tmp_path / "flight") == {}


def topology(rank=0, size=1, local_rank=0):
    from hvdtrain.distributed.world import World
    from hvdtrain.parallel.topology import Topology

    return Topology(World(rank=rank, size=size, local_rank=local_rank, local_size=size, cross_rank=0, cross_size=1,
                          hostname="hostA", controller="gloo", launcher="test", threads=1, device=torch.device("cpu")))


def recording(topology):
    """A Trainer's flight recording (16 entries); USR2 is the preemption's: the service takes no signal."""
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.fault_tolerance.flight import FlightRecording

    return FlightRecording(TrainConfig(flight_recorder=16, preempt_signal="USR2"), topology)


def test_a_stall_report_says_where_the_flight_record_went(tmp_path, capsys):
    flight = recording(topology())
    flight.open(tmp_path)  # USR2 is the preemption's: the service takes no signal
    fired = threading.Event()
    dog = StallWatchdog(0.3, 0, "hostA", lambda: [], exit_process=lambda code: fired.set())
    dog.flight = flight
    try:
        dog.start()
        assert fired.wait(20)
    finally:
        flight.close()
    err = capsys.readouterr().err
    path = tmp_path / "flight" / "rank-00000.json"
    assert f"Flight record: {path}." in err and json.loads(path.read_text())["reason"] == "stall"
    assert "[hvdtrain] flight records: no divergence" in err


def test_hvdtrain_debug_analyze_prints_the_verdict(tmp_path):
    flight = tmp_path / "flight"
    flight.mkdir()
    for record in (dump(0, common(2) + [entry(2, "x", end=False)]), dump(1, common(2))):
        (flight / f"rank-{record['rank']:05d}.json").write_text(json.dumps(record))
    run = subprocess.run([sys.executable, "-m", "hvdtrain.cli", "debug", "analyze", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0].startswith("rank 1 never entered allreduce 'x' (seq 2")
    nothing = subprocess.run([sys.executable, "-m", "hvdtrain.cli", "debug", "dump", str(tmp_path)],
                             capture_output=True, text=True, timeout=300)
    assert nothing.returncode == 1 and "no rank of a running job announced itself" in nothing.stderr


HOOKED = """
import torch, horovod.torch as hvd
hvd.init()
from hvdtrain.distributed import flight_hooks
from hvdtrain.common.flight.recorder import RECORDER
assert flight_hooks.install() == []
hvd.allreduce(torch.ones(3), name="a")
hvd.broadcast_object({"x": 1}, root_rank=0, name="obj")
hvd.synchronize(hvd.grouped_allreduce_async([torch.ones(2), torch.ones(2, 2)], name="g"))
hvd.barrier()
print([(e[0], e[1], e[2], None if e[3] is None else list(e[3]) if e[1] != "grouped_allreduce" else [list(s) for s in e[3]],
        e[7] is not None) for e in RECORDER.collectives])
"""


def test_every_horovod_operation_is_recorded_through_the_hooks():
    run = subprocess.run([sys.executable, "-c", HOOKED], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == str([
        (0, "allreduce", "a", [3], True), (1, "broadcast", "obj.sz", [1], True), (2, "broadcast", "obj.t", [21], True),
        (3, "grouped_allreduce", "g", [[2], [2, 2]], True), (4, "barrier", None, None, True)])


@pytest.fixture
def fresh_recorder():
    """The process's recorder, emptied, and emptied again after the test."""
    from hvdtrain.common.flight.recorder import DEFAULT_CAPACITY, RECORDER

    RECORDER.resize(16)
    yield RECORDER
    RECORDER.resize(DEFAULT_CAPACITY)


def test_with_the_run_directory_on_a_hung_mount_the_stall_is_reported_and_the_job_ends(tmp_path, monkeypatch,
                                                                                      capsys):
    """Every mkdir under the run directory blocks from the stall on (a mount that stopped answering):
    the STALL line is out, and the process exits, without the flight record."""
    import pathlib

    from hvdtrain.fault_tolerance import watchdog

    monkeypatch.setattr(watchdog, "FLIGHT_DUMP_SECONDS", 1.0, raising=False)
    flight = recording(topology())
    flight.open(tmp_path)
    answering, real_mkdir = threading.Event(), pathlib.Path.mkdir

    def mkdir(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            answering.wait(120)
        return real_mkdir(path, *args, **kwargs)
    monkeypatch.setattr(pathlib.Path, "mkdir", mkdir)
    fired = threading.Event()
    dog = StallWatchdog(0.3, 0, "hostA", lambda: [], exit_process=lambda code: fired.set())
    dog.flight = flight
    try:
        dog.start()
        assert fired.wait(30), "the watchdog never ended the job"
    finally:
        answering.set()
        join_stall_records()
        flight.close()
    err = capsys.readouterr().err
    stall = err.index("[hvdtrain] STALL rank 0 on hostA: no step finished")
    assert stall < err.index("flight record not written in 3 s"), err


def test_a_wait_that_raises_ends_its_entry_as_failed(fresh_recorder, tmp_path):
    """A rank died: Horovod's wait raises. The entry ends with the error: not in flight any more."""
    from hvdtrain.distributed import flight_hooks

    flight = recording(topology())
    waiting = {}
    start = flight_hooks._recording(lambda *args: "handle-1", fresh_recorder, waiting, "allreduce", 0, 2, 6)

    def wait(handle):
        raise RuntimeError("Horovod has been shut down. This was caused by an exception on one of the ranks")

    def barrier(*args, **kwargs):
        raise RuntimeError("Horovod has been shut down")
    start(torch.ones(3), None, "grad.0")
    assert flight.in_flight() == ["allreduce 'grad.0'"]
    with pytest.raises(RuntimeError):
        flight_hooks._ending(wait, fresh_recorder, waiting)("handle-1")
    with pytest.raises(RuntimeError):
        flight_hooks._blocking(barrier, fresh_recorder, "barrier")()
    assert flight.in_flight() == [] and waiting == {}
    record = {"format": "hvdtrain-flight/1", "rank": 0, "size": 1, "written": time.time(),
              **fresh_recorder.snapshot()}
    first, second = record["collectives"]
    assert first["end"] is not None and first["error"].startswith("RuntimeError: Horovod has been shut down. This")
    assert second["op"] == "barrier" and second["end"] is not None and second["error"]
    assert ("rank 0: allreduce 'grad.0' (seq 0 of the global process set) failed: RuntimeError: Horovod has been "
            "shut down") in "\n".join(analysis.analyze([record]).lines())


def test_after_a_world_change_the_numbers_restart_and_the_service_answers_as_the_new_rank(
        fresh_recorder, tmp_path, monkeypatch):
    """Rank 1 of 3 survives a world change as rank 0 of 2 (Horovod elastic); the new world's first
    collectives are the sync's broadcasts, on the survivor and on a worker that joined alike."""
    from dataclasses import replace

    from hvdtrain.distributed import startup

    survivor = topology(rank=1, size=3, local_rank=1)
    flight = recording(survivor)
    flight.open(tmp_path)
    try:
        for i in range(5):
            fresh_recorder.end(fresh_recorder.start("allreduce", f"grad.{i}", (4,), "float32", 0))
        fresh_recorder.start("allreduce", "grad.5", (4,), "float32", 0)  # in flight as the world broke
        monkeypatch.setattr(startup, "reformed", lambda world: replace(world, rank=0, size=2, local_size=2))
        survivor.reform()
        assert list(alive_ranks(tmp_path / "flight")) == [0]  # the service follows: rank 1's alive file went
        for i in range(3):
            fresh_recorder.end(fresh_recorder.start("broadcast", f"elastic.{i}", (1,), "int64", 0))
        mine = json.loads(flight.dump("test").read_text())
    finally:
        flight.close()
    assert (mine["rank"], mine["size"]) == (0, 2)
    assert [(e["seq"], e["name"]) for e in mine["collectives"]] == [(i, f"elastic.{i}") for i in range(3)]
    assert [e["name"] for e in mine["previous_world"]["collectives"]] == [f"grad.{i}" for i in range(6)]
    joiner = {**mine, "rank": 1, "world_since": mine["written"] - 1, "previous_world": None,
              "collectives": [{**e, "start": e["start"] + 0.5} for e in mine["collectives"]]}
    found = analysis.analyze([mine, joiner])
    assert found.divergence is None and found.last_seq == {"0": 2} and found.ranks == [0, 1]


def test_a_dump_left_from_an_earlier_world_is_set_aside():
    """Ranks 0 and 1 dumped in a world of 2 that began at T0 + 500; rank 2's file is from the world
    of 3 before it (seq numbers of another count): never compared, named."""
    began = T0 + 500
    new = [dict(dump(r, [entry(i, f"elastic.{i}", start=began + i) for i in range(3)]), world_since=began)
           for r in range(2)]
    old = dump(2, common(7) + [entry(7, "grad.7", end=False)], size=3, written=T0 + 400)
    found = analysis.analyze(new + [old])
    assert found.divergence is None and (found.ranks, found.size, found.earlier_world) == ([0, 1], 2, [2])
    assert found.verdict().startswith("no divergence in the collectives of 2 ranks")
    assert any(line.startswith("set aside") and line.endswith("the dumps of rank 2") for line in found.lines())


def answered(flight, rank, token):
    try:
        return json.loads((flight / f"rank-{rank:05d}.json").read_text()).get("request") == token
    except (OSError, ValueError):
        return False


def test_one_rank_per_host_reads_the_request_file_and_every_rank_answers(tmp_path, monkeypatch):
    """Three ranks of one host: only local rank 0's thread reads RUN_DIR/flight/request (shared
    storage); it hands the token on through the host's memory, and every rank dumps."""
    from collections import Counter

    from hvdtrain.common.flight import dumps

    monkeypatch.setattr(dumps, "POLL_SECONDS", 0.05)
    reads, read_token = Counter(), dumps.read_token
    monkeypatch.setattr(dumps, "read_token",
                        lambda directory: reads.update([threading.current_thread().name]) or read_token(directory))
    flight, host = tmp_path / "run" / "flight", tmp_path / "shm"
    host.mkdir()

    def answer(rank):
        return lambda reason, extra: write_dump(flight, rank, 3, reason, FlightRecorder(4), extra=extra)
    services = [DumpService(flight, rank, 3, "", answer(rank), local_rank=rank, host_directory=host).start()
                for rank in range(3)]
    try:
        time.sleep(0.5)  # about ten polls each
        token = request_dump(tmp_path / "run")
        wait_for(lambda: all(answered(flight, rank, token) for rank in range(3)))
    finally:
        for service in services:
            service.stop()
    polling = {name: count for name, count in reads.items() if name != threading.current_thread().name}
    assert list(polling) == ["hvdtrain-flight-rank0"] and polling["hvdtrain-flight-rank0"] >= 5, reads
    assert list(host.iterdir()) == []  # the host's mailbox goes with its local rank 0

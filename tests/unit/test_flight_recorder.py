"""The flight recorder: its ring buffers, the dumps (on request, on SIGUSR2, on a stall) and the
analysis of constructed dumps: a skipped collective, another order, another shape, a slow rank."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest

from hvdtrain.common.flight import analysis
from hvdtrain.common.flight.dumps import DumpService, alive_ranks, request_dump, write_dump
from hvdtrain.common.flight.recorder import FlightRecorder
from hvdtrain.fault_tolerance.watchdog import StallWatchdog

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


def test_a_stall_report_says_where_the_flight_record_went(tmp_path, capsys):
    from hvdtrain.config.train import TrainConfig
    from hvdtrain.fault_tolerance.flight import FlightRecording

    world = types.SimpleNamespace(rank=0, size=1, hostname="hostA")
    topology = types.SimpleNamespace(world=world, is_root=True, log=types.SimpleNamespace(info=print, warning=print))
    flight = FlightRecording(TrainConfig(flight_recorder=16, preempt_signal="USR2"), topology)
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

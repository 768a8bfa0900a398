"""``hvdtrain bench collectives`` run for real on 2 ranks, tiny: complete, sane output (never speed)."""
import json
import math
import re

import pytest

from hvdtrain import cli

from hvdtrain.bench.collectives import driver as collectives
from tests.launch.helpers import BIN, run

SIZES = (4096, 1 << 20)
RANKS = 2
HEADER = ["size(B)", "count", "backend", "time(us)", "+-%", "n", "algbw(GB/s)", "busbw(GB/s)",
          "x raw MPI", "x MPI alone"]
# nccl-tests' bus bandwidth factors at 2 ranks, written out rather than taken from the code under test.
BUSBW_FACTOR = {"allreduce": 1.0, "broadcast": 1.0, "allgather": 0.5}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SWEEP_TIMEOUT = 240  # seconds: three jobs of ~10 s each on an idle machine, slower on a shared one


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One real run, shared by the tests below: (output directory, stdout, results.json)."""
    out = tmp_path_factory.mktemp("collectives")
    code, stdout, stderr = run([str(BIN / "hvdtrain"), "bench", "collectives", "-np", str(RANKS),
                                "--sizes", "4K,1M", "--rounds", "1", "--iters", "3", "--warmup", "1",
                                "--repeats", "1", "--out", str(out)], timeout=SWEEP_TIMEOUT)
    assert code == 0, f"exit {code}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return out, stdout, json.loads((out / "results.json").read_text())


@pytest.mark.timeout(SWEEP_TIMEOUT + 30)
def test_every_op_backend_and_size_has_a_positive_finite_time(sweep):
    _, _, results = sweep
    seen = {(m["op"], m["backend"], m["size"]) for m in results["measurements"]
            if m["seconds"] > 0 and math.isfinite(m["seconds"])}
    wanted = {(op, backend, size)
              for op in collectives.OPS for backend in collectives.BACKENDS for size in SIZES}
    assert wanted <= seen, f"missing or not a positive finite time: {sorted(wanted - seen)}"
    assert all(m["seconds"] > 0 and math.isfinite(m["seconds"]) for m in results["measurements"])
    summarized = {(s["op"], s["backend"], s["size"]) for s in results["summaries"]}
    assert summarized == wanted


@pytest.mark.timeout(SWEEP_TIMEOUT + 30)
def test_bandwidths_follow_the_nccl_tests_definitions(sweep):
    _, _, results = sweep
    for row in results["summaries"]:
        median_us = row["time_us"]["median"]
        assert row["time_us"]["min"] <= median_us <= row["time_us"]["max"]
        if row["backend"] == "memcpy":
            assert row["copy_GBps"] == pytest.approx(row["size"] / median_us / 1e3)
            continue
        assert row["algbw_GBps"] == pytest.approx(row["size"] / median_us / 1e3), row
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * BUSBW_FACTOR[row["op"]]), row


@pytest.mark.timeout(SWEEP_TIMEOUT + 30)
def test_horovod_ratios_and_the_target_are_reported(sweep):
    _, _, results = sweep
    for row in results["summaries"]:
        if row["backend"] in ("horovod_mpi", "horovod_gloo"):
            assert row["vs_raw_mpi"] > 0 and math.isfinite(row["vs_raw_mpi"]), row
            assert row["vs_raw_mpi"] == pytest.approx(
                next(s["time_us"]["median"] for s in results["summaries"]
                     if (s["op"], s["size"], s["backend"]) == (row["op"], row["size"], "mpi"))
                / row["time_us"]["median"])
    assert set(results["target"]["ratios"]) == {str(1 << 20)}  # JSON keys; only 1M is >= 1 MiB
    assert results["target"]["met"] in (True, False)


@pytest.mark.timeout(SWEEP_TIMEOUT + 30)
def test_each_job_ran_the_horovod_backend_it_is_labelled_with(sweep):
    _, _, results = sweep
    horovod = {run["mode"]: run["horovod"] for run in results["runs"]}
    assert horovod["mpi"]["mpi_enabled"] and not horovod["mpi"]["gloo_enabled"]
    assert horovod["gloo"]["gloo_enabled"] and not horovod["gloo"]["mpi_enabled"]
    assert horovod["mpi_alone"] is None  # raw MPI alone: no Horovod in those processes


@pytest.mark.timeout(SWEEP_TIMEOUT + 30)
def test_printed_tables_have_the_header_every_size_and_a_verdict(sweep):
    out, stdout, _ = sweep
    for op in collectives.OPS:
        lines = stdout.split(f"{op}: fp32, {RANKS} ranks")[1].split("\n\n")[0].splitlines()
        table = "\n".join(lines)
        assert re.split(r"\s{2,}", lines[1].strip()) == HEADER  # columns are 2+ spaces apart
        sizes_printed = {int(line.split()[0]) for line in lines[3:]}
        assert sizes_printed == set(SIZES)
        for label in collectives.LABELS.values():
            assert label in table
    assert "target: Horovod-MPI all-reduce >= 0.90 x raw MPI at every size >= 1 MiB: " in stdout
    assert (out / "collectives.png").read_bytes()[:8] == PNG_SIGNATURE


def test_a_bad_size_names_the_token_and_the_accepted_form(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["bench", "collectives", "--sizes", "4K,3X"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "'3X' is not a size" in error and "4K,1M,64M" in error


def test_a_size_that_does_not_split_over_the_ranks_is_refused_before_any_launch(capsys):
    assert cli.main(["bench", "collectives", "-np", "2", "--sizes", "4K,6"]) == 2
    error = capsys.readouterr().err
    assert "--sizes: 6 (6 bytes)" in error and "multiple of 8 bytes" in error


def test_sizes_parse_with_binary_suffixes():
    assert collectives.parse_sizes("64M,4K,1m,4096,2KiB") == [2048, 4096, 1 << 20, 64 << 20]

"""``hvdtrain bench throughput`` and ``scaling`` run for real, tiny: complete, sane output (never speed)."""
import argparse
import json
import math

import pytest

from hvdtrain import cli
from hvdtrain.bench.common import jobs as bench_jobs
from hvdtrain.bench.scaling import driver as scaling
from hvdtrain.bench.throughput import driver as throughput, worker as throughput_worker
from hvdtrain.bench.common import workloads
from hvdtrain.launch.hostfile import Host
from tests.launch.helpers import BIN, run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# 13 jobs of a few seconds each (start-up dominates), then 2 scaling jobs. A guard against a hang, not a
# speed bound: about 190 s on 2 idle AVX2 cores, and past 240 s on the same cores loaded by other work.
THROUGHPUT_TIMEOUT = 480
SCALING_TIMEOUT = 120


def finite_positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def throughput_run(tmp_path_factory):
    """One real --quick run on 2 workers (the CNN; the knobs on the CNN and the many-tensor model)."""
    out = tmp_path_factory.mktemp("throughput")
    code, stdout, stderr = run([str(BIN / "hvdtrain"), "bench", "throughput", "--quick", "--models", "cnn",
                                "--knob-model", "cnn", "--workers", "2", "--timeout", "120", "--out", str(out)],
                               timeout=THROUGHPUT_TIMEOUT)
    assert code == 0, f"exit {code}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return out, stdout, json.loads((out / "results.json").read_text())


def medians(results):
    return {job["key"]: job["samples_per_sec"]["median"] for job in results["jobs"] if not job["skipped"]}


def measured(rows):
    return [row for row in rows if not row["skipped"]]


@pytest.mark.timeout(THROUGHPUT_TIMEOUT + 30)
def test_every_variant_ran_once_with_a_positive_finite_rate(throughput_run):
    _, _, results = throughput_run
    rows = {row["variant"]: row for row in results["models"]["cnn"]["rows"]}
    assert set(rows) == set(throughput.DEFAULT_VARIANTS)
    # This machine has no GPU: DataParallel is in the table, skipped with its reason, never launched.
    dataparallel = rows.pop("dataparallel")
    assert dataparallel["skipped"].startswith("DataParallel needs 2 or more GPUs, this machine has ")
    assert dataparallel["samples_per_sec"] is None and dataparallel["workers"] == 2
    for variant, row in rows.items():
        assert row["samples_per_sec"]["repeats"] == 1 and not row["errors"] and not row["skipped"], row
        assert finite_positive(row["samples_per_sec"]["median"]), row
        assert row["workers"] == (1 if variant == "single" else 2)
    (job,) = [job for job in results["jobs"] if job["skipped"]]
    assert job["key"] == "cnn/dataparallel" and job["runs"] == [] and job["samples_per_sec"] is None
    for job in results["jobs"]:
        if job["skipped"]:
            continue
        (result,) = job["runs"]
        assert result["world_size"] == job["workers"]
        assert len(result["elapsed_per_rank_s"]) == len(result["peak_rss_mb_per_rank"]) == job["workers"]
        assert all(finite_positive(rss) for rss in result["peak_rss_mb_per_rank"])
        assert result["samples_per_sec"] == pytest.approx(result["samples"] / result["elapsed_s"])
        # --quick times one segment: its rate is the job's
        assert result["best_segment_samples_per_sec"] == pytest.approx(result["samples_per_sec"])
        assert result["torch_threads"] == 1


@pytest.mark.timeout(THROUGHPUT_TIMEOUT + 30)
def test_ratios_and_efficiencies_are_those_of_the_medians(throughput_run):
    _, _, results = throughput_run
    rate = medians(results)
    table = results["models"]["cnn"]
    for name, value in table["ratios"].items():
        numerator, denominator = name.split("/")
        assert value == pytest.approx(rate[f"cnn/{numerator}"] / rate[f"cnn/{denominator}"]), name
    assert {"trainer/horovod", "trainer/ddp", "trainer/trainer-noyield"} <= set(table["ratios"])
    for row in measured(table["rows"]):
        assert row["efficiency"] == pytest.approx(rate[row["key"]] / (row["workers"] * rate["cnn/single"]))
        if row["workers"] == 2:
            assert row["vs_ceiling"] == pytest.approx(rate[row["key"]] / rate["cnn/independent"])
        if row["variant"] in ("trainer", "trainer-noyield", "horovod", "horovod-hvdenv"):
            assert 0 <= row["comm_share"] <= 1, row  # the wait in synchronize() is part of the step


@pytest.mark.timeout(THROUGHPUT_TIMEOUT + 30)
def test_every_knob_is_a_ratio_against_its_variant_without_it(throughput_run):
    _, _, results = throughput_run
    rate = medians(results)
    knobs = {knob["knob"]: knob for knob in results["knobs"]}
    assert set(knobs) == {"fusion-off", "cycle-5ms", "fp16", "accumulation-4", "timeline-armed"}
    for key, knob in knobs.items():
        changed = rate[f"{knob['model']}/{knob['variant']}/{key}"]
        default = rate[f"{knob['model']}/{knob['variant']}"]
        assert knob["ratio"] == pytest.approx(changed / default), key
    assert knobs["fusion-off"]["model"] == "many"
    jobs = {job["key"]: job["runs"][0] for job in results["jobs"] if not job["skipped"]}
    assert jobs["many/trainer/fusion-off"]["env"]["HOROVOD_FUSION_THRESHOLD"] == "0"
    assert jobs["cnn/trainer/cycle-5ms"]["env"]["HOROVOD_CYCLE_TIME"] == "5"
    assert jobs["cnn/trainer/fp16"]["fp16"] and jobs["cnn/trainer/accumulation-4"]["accumulation"] == 4
    assert jobs["cnn/horovod-hvdenv"]["env"]["HOROVOD_TIMELINE"] is None  # armed only when asked for
    assert jobs["cnn/horovod-hvdenv/timeline-armed"]["env"]["HOROVOD_TIMELINE"] == "DYNAMIC"
    assert workloads.parameter_count(workloads.build_model("many", 0))[1] >= 200


@pytest.mark.timeout(THROUGHPUT_TIMEOUT + 30)
def test_hvdtrain_default_reaches_open_mpi_and_the_user_can_turn_it_off(throughput_run):
    """dist.init sets OMPI_MCA_mpi_yield_when_idle before hvd.init: Open MPI's own variable shows it."""
    _, _, results = throughput_run
    jobs = {job["key"]: job["runs"][0] for job in results["jobs"] if not job["skipped"]}
    assert jobs["cnn/trainer"]["mpi_yield_when_idle"] is True
    assert jobs["cnn/horovod-hvdenv"]["mpi_yield_when_idle"] is True
    assert jobs["cnn/trainer-noyield"]["mpi_yield_when_idle"] is False  # the user's 0 wins
    assert jobs["cnn/horovod"]["mpi_yield_when_idle"] is False  # Horovod alone: Open MPI's default
    assert jobs["cnn/single"]["mpi_yield_when_idle"] is None  # no MPI in that process


@pytest.mark.timeout(THROUGHPUT_TIMEOUT + 30)
def test_tables_verdicts_and_plot_are_written(throughput_run):
    out, stdout, results = throughput_run
    assert "cnn: global samples/s, batch 16/worker" in stdout
    assert "knobs, each against the same variant without it, in the same run" in stdout
    assert "skipped: DataParallel needs 2 or more GPUs, this machine has 0" in stdout
    verdicts = results["verdicts"]
    assert [v["target"] for v in verdicts] == [
        "hvdtrain Trainer vs plain Horovod loop (Horovod's defaults), cnn",
        "hvdtrain Trainer vs plain Horovod loop (with hvdtrain's env defaults), cnn",
        "hvdtrain Trainer vs PyTorch DDP (gloo), cnn",
        "weak-scaling efficiency, cnn, 2 workers (Trainer)"]
    for verdict in verdicts:
        assert verdict["met"] in (True, False)
        assert f"target: {verdict['target']} >= {verdict['threshold']:g}: measured" in stdout
    assert (out / "throughput.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (out / "report.txt").read_text().strip()


@pytest.mark.timeout(SCALING_TIMEOUT + 30)
def test_scaling_reports_each_worker_count_and_its_efficiency(tmp_path):
    code, stdout, stderr = run([str(BIN / "hvdtrain"), "bench", "scaling", "-H", "localhost:2", "--rounds", "1",
                                "--steps", "3", "--warmup", "1", "--batch", "16", "--samples", "256",
                                "--timeout", "100", "--out", str(tmp_path)], timeout=SCALING_TIMEOUT)
    assert code == 0, f"exit {code}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["workers"]: row for row in results["rows"]}
    assert set(rows) == {1, 2}
    assert rows[1]["efficiency"] == pytest.approx(1.0)
    assert rows[2]["efficiency"] == pytest.approx(
        rows[2]["samples_per_sec"]["median"] / (2 * rows[1]["samples_per_sec"]["median"]))
    for row in rows.values():
        assert finite_positive(row["samples_per_sec"]["median"]) and 0 <= row["comm_share"] <= 1
    assert results["runs"]["2"][0]["world_size"] == 2
    assert (tmp_path / "scaling.png").read_bytes()[:8] == PNG_SIGNATURE
    assert "efficiency" in stdout


def test_worker_counts_step_by_one_then_double_and_end_at_n():
    assert scaling.worker_counts(1) == [1]
    assert scaling.worker_counts(2) == [1, 2]
    assert scaling.worker_counts(20) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 20]
    assert scaling.worker_counts(32) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32]


def test_scaling_takes_the_hosts_from_the_options_then_slurm_then_this_host():
    slurm = {"SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "4(x2)"}
    assert scaling.resolve_hosts(None, "a:2,b:2", slurm) == [Host("a", 2), Host("b", 2)]
    assert scaling.resolve_hosts(None, None, slurm) == [Host("node01", 4), Host("node02", 4)]
    assert scaling.resolve_hosts(None, None, {}) == []


def test_unknown_variant_is_refused_before_any_launch(capsys):
    assert cli.main(["bench", "throughput", "--variants", "trainer,ddp2"]) == 2
    assert "unknown variant ddp2" in capsys.readouterr().err


def test_the_workloads_have_the_sizes_the_report_claims():
    cnn = workloads.parameter_count(workloads.build_model("cnn", 0))
    mlp = workloads.parameter_count(workloads.build_model("mlp", 0))
    assert 1.0e6 < cnn[0] < 1.5e6 and 24e6 < mlp[0] < 26e6


# ---- DataParallel: a baseline on machines with 2 or more GPUs, skipped with its reason elsewhere ----
# Running it needs GPUs, which the machines of these tests do not have: the tests below check the
# skip, the command and the layout it is given, and that its code path imports and refuses to start.

def bench_args(**overrides):
    values = dict(models="cnn", variants="single,dataparallel", workers=2, rounds=1, batch=16, steps=3,
                  warmup=1, segments=1, samples=512, knob_model="cnn", knobs=False, timeout=60, quick=False)
    return argparse.Namespace(**{**values, **overrides})


def fake_result(args):
    """What a worker job's rank 0 would write, as far as the report reads it."""
    rate = 100.0
    return {"samples_per_sec": rate, "best_segment_samples_per_sec": rate, "peak_rss_mb_per_rank": [10.0],
            "comm_share": None, "cpu_other_cores": 0.0, "worker_args": list(args)}


@pytest.mark.parametrize("gpus", [0, 1])
def test_dataparallel_is_skipped_with_its_reason_below_two_gpus(monkeypatch, tmp_path, capsys, gpus):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    launched = []

    def run_job(module, args, np, launcher, timeout, env=None):
        launched.append(args)
        return fake_result(args)

    monkeypatch.setattr(bench_jobs, "run_job", run_job)
    assert throughput.run(bench_args(out=str(tmp_path))) == 0  # the rest ran: a skip is not a failure
    reason = f"DataParallel needs 2 or more GPUs, this machine has {gpus}"
    assert [args[1] for args in launched] == ["single"]  # never launched
    stdout = capsys.readouterr().out
    (line,) = [line for line in stdout.splitlines() if line.startswith("torch.nn.DataParallel")]
    assert line.split()[:7] == ["torch.nn.DataParallel,", "one", "process", "over", "N", "GPUs", "2"]
    assert line.endswith(f"skipped: {reason}")  # in its row of the table, across the figures' columns
    results = json.loads((tmp_path / "results.json").read_text())
    jobs = {job["key"]: job for job in results["jobs"]}
    assert jobs["cnn/dataparallel"]["skipped"] == reason and jobs["cnn/dataparallel"]["runs"] == []
    assert jobs["cnn/single"]["skipped"] is None and len(jobs["cnn/single"]["runs"]) == 1
    rows = {row["variant"]: row for row in results["models"]["cnn"]["rows"]}
    assert rows["dataparallel"]["skipped"] == reason and rows["dataparallel"]["samples_per_sec"] is None
    assert "trainer/dataparallel" not in results["models"]["cnn"]["ratios"]


@pytest.mark.parametrize("workers", [2, 3])
def test_dataparallel_command_with_enough_gpus_is_one_process_at_the_global_batch(monkeypatch, tmp_path, workers):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: max(2, workers))
    all_jobs, _ = throughput.plan(bench_args(workers=workers, variants="trainer,dataparallel"))
    jobs = {job.key: job for job in all_jobs}
    job, trainer = jobs["cnn/dataparallel"], jobs["cnn/trainer"]
    assert job.skipped is None and (job.np, job.workers, job.variant.launcher) == (1, workers, "none")
    assert (trainer.np, trainer.workers) == (workers, workers)
    argv = bench_jobs.worker_argv(throughput.WORKER, job.args, tmp_path / "result.json", job.np, job.variant.launcher)
    assert argv[1:3] == ["-m", "hvdtrain.bench.throughput.worker"]  # no mpirun: one process
    args = throughput_worker.parse_args(argv[3:])
    assert (args.variant, args.model, args.devices, args.batch) == ("dataparallel", "cnn", workers, 16)
    # hvdtrain's workers take --batch each: DataParallel takes all of them at once, over GPUs 0..N-1
    assert throughput_worker.parse_args(["--out", "x", *trainer.args]).batch == 16
    assert throughput_worker.dataparallel_layout(args.batch, args.devices) == {
        "global_batch": 16 * workers, "device_ids": list(range(workers)), "output_device": 0}
    assert throughput_worker.RUNNERS["dataparallel"] is throughput_worker.run_dataparallel


def test_dataparallel_over_more_workers_than_gpus_is_skipped(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    (job,) = throughput.plan(bench_args(workers=4, variants="dataparallel"))[0]
    assert job.skipped == "DataParallel over 4 GPUs (--workers 4) needs 4 GPUs, this machine has 2"
    (job,) = throughput.plan(bench_args(workers=1, variants="dataparallel"))[0]
    assert job.skipped == "DataParallel over 1 GPU is the one-process run: use --workers 2 or more"


def test_dataparallel_worker_refuses_bad_devices_and_a_machine_without_them(monkeypatch, tmp_path):
    common = ["--out", str(tmp_path / "r.json"), "--model", "cnn"]
    for argv in (["--variant", "dataparallel"], ["--variant", "single", "--devices", "2"],
                 ["--variant", "dataparallel", "--devices", "1"]):
        with pytest.raises(SystemExit):
            throughput_worker.parse_args(common + argv)
    # The run itself starts, then stops before touching a GPU on a machine with too few.
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit, match="--devices 2 but this machine has 0 GPUs"):
        throughput_worker.run_dataparallel(throughput_worker.parse_args(
            common + ["--variant", "dataparallel", "--devices", "2", "--steps", "1", "--segments", "1"]))

"""``hvdtrain bench throughput`` and ``scaling`` run for real, tiny: complete, sane output (never speed)."""
import json
import math

import pytest

from hvdtrain import cli
from hvdtrain.bench import scaling, throughput, workloads
from hvdtrain.launch.hostfile import Host
from tests.launch.helpers import BIN, run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# 13 jobs of a few seconds each (start-up dominates), then 2 scaling jobs; slower on a shared machine.
THROUGHPUT_TIMEOUT = 240
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
    return {job["key"]: job["samples_per_sec"]["median"] for job in results["jobs"]}


@pytest.mark.timeout(THROUGHPUT_TIMEOUT + 30)
def test_every_variant_ran_once_with_a_positive_finite_rate(throughput_run):
    _, _, results = throughput_run
    rows = {row["variant"]: row for row in results["models"]["cnn"]["rows"]}
    assert set(rows) == set(throughput.DEFAULT_VARIANTS)
    for variant, row in rows.items():
        assert row["samples_per_sec"]["repeats"] == 1 and not row["errors"], row
        assert finite_positive(row["samples_per_sec"]["median"]), row
        assert row["workers"] == (1 if variant == "single" else 2)
    for job in results["jobs"]:
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
    for row in table["rows"]:
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
    jobs = {job["key"]: job["runs"][0] for job in results["jobs"]}
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
    jobs = {job["key"]: job["runs"][0] for job in results["jobs"]}
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

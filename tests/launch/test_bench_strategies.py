"""``hvdtrain bench strategies`` runs for real, tiny: complete, sane output (never speed).

The memory rows are checked against relations that hold exactly in the counted bytes (only the
padding of the flat buckets to a multiple of the worker count, and Adam's step scalars, differ).
"""
import json
import math

import pytest

from hvdtrain import cli
from hvdtrain.bench.strategies import driver as strategies
from tests.launch.helpers import BIN, run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# 8 jobs (4 speed, 4 memory) of a few seconds each: start-up dominates (about 2 minutes in all
# while other tests ran beside it).
TIMEOUT = 300


def finite_positive(value):
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def strategies_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("strategies")
    code, stdout, stderr = run([str(BIN / "hvdtrain"), "bench", "strategies", "--quick", "--workers", "2",
                                "--memory-workers", "2", "--timeout", "100", "--out", str(out)], timeout=TIMEOUT)
    assert code == 0, f"exit {code}\n{stdout[-3000:]}\n{stderr[-3000:]}"
    return out, stdout, json.loads((out / "results.json").read_text())


@pytest.mark.timeout(TIMEOUT + 30)
def test_every_strategy_ran_through_the_trainer_with_a_positive_finite_rate(strategies_run):
    out, _, results = strategies_run
    rows = {row["strategy"]: row for row in results["speed"]}
    assert list(rows) == list(strategies.STRATEGIES)
    for name, row in rows.items():
        assert row["samples_per_sec"]["repeats"] == 1 and not row["errors"], row
        assert finite_positive(row["samples_per_sec"]["median"]) and row["workers"] == 2
        assert 0 <= row["comm_share"] <= 1
        # the parts of a step are parts of it (the step is the slowest rank's, parts a mean over ranks)
        assert 0 <= row["gradient_wait_ms"] < row["step_ms"] and 0 < row["update_ms"] <= row["strategy_step_ms"]
    for job in results["jobs"]:
        (result,) = job["runs"]
        assert result["variant"] == "trainer" and result["strategy"] == job["strategy"]
        assert result["world_size"] == job["workers"] == len(result["memory_per_rank"])
        assert result["torch_threads"] == 1
        if job["key"].startswith("memory/"):
            assert result["optimizer"] == "adam"
    assert (out / "strategies.png").read_bytes()[:8] == PNG_SIGNATURE
    assert (out / "report.txt").read_text().strip()


@pytest.mark.timeout(TIMEOUT + 30)
def test_ratios_to_ddp_are_those_of_the_medians_and_the_targets_are_judged(strategies_run):
    _, stdout, results = strategies_run
    rate = {row["strategy"]: row["samples_per_sec"]["median"] for row in results["speed"]}
    for row in results["speed"]:
        assert row["ratio_to_ddp"] == pytest.approx(rate[row["strategy"]] / rate["ddp"])
        assert row["paired_ratio_to_ddp"]["median"] == pytest.approx(row["ratio_to_ddp"])  # one round
    verdicts = {v["target"]: v for v in results["verdicts"]}
    assert set(verdicts) == {f"{name} samples/s vs ddp, cnn, 2 workers" for name in ("zero1", "zero2", "fsdp")}
    for target, verdict in verdicts.items():
        name = target.split()[0]
        assert verdict["threshold"] == {"zero1": 0.95, "zero2": 1.00, "fsdp": 0.95}[name]
        assert verdict["met"] == (verdict["measured"] >= verdict["threshold"])
        assert f"target: {verdict['target']} >= {verdict['threshold']:g}: measured {verdict['measured']:.3f}" in stdout
        assert ("why" in verdict) == (not verdict["met"])


@pytest.mark.timeout(TIMEOUT + 30)
def test_counted_bytes_follow_what_each_strategy_shards(strategies_run):
    _, stdout, results = strategies_run
    rows = {row["strategy"]: row for row in results["memory"] if row["workers"] == 2}
    assert set(rows) == set(strategies.STRATEGIES)
    psi = results["parameters"]
    ddp, zero1, zero2, fsdp = (rows[name]["rank0"] for name in ("ddp", "zero1", "zero2", "fsdp"))
    for name, row in rows.items():
        assert row["parameters_counted"] == psi and row["max"]["total"] >= row["rank0"]["total"]
        assert row["rank0"]["total"] == sum(row["rank0"][k] for k in strategies.COMPONENTS)
        assert row["counted_over_formula"]["total"] == pytest.approx(1.0, rel=0.01), name
    # ddp holds everything in fp32: parameters and gradients 4 bytes each, Adam's two moments 8
    assert ddp["parameters"] == ddp["gradients"] == 4 * psi
    assert ddp["optimizer_state"] == pytest.approx(8 * psi, rel=1e-3)
    # no stage shards the parameters; zero1 keeps full gradients; both keep half of Adam's state
    assert zero1["parameters"] == pytest.approx(ddp["parameters"], rel=1e-3)
    assert zero2["parameters"] == pytest.approx(ddp["parameters"], rel=1e-3)
    assert zero1["gradients"] == pytest.approx(ddp["gradients"], rel=1e-3)
    assert zero2["gradients"] == pytest.approx(ddp["gradients"] / 2, rel=1e-3)
    for zero in (zero1, zero2, fsdp):
        assert zero["optimizer_state"] == pytest.approx(ddp["optimizer_state"] / 2, rel=1e-3)
    # fsdp, counted between steps: half of everything at 2 ranks
    assert fsdp["parameters"] == pytest.approx(ddp["parameters"] / 2, rel=1e-3)
    assert fsdp["gradients"] == pytest.approx(ddp["gradients"] / 2, rel=1e-3)
    assert ddp["total"] > zero1["total"] > zero2["total"] > fsdp["total"]
    # fsdp during a step: its shards plus at least the largest unit, gathered
    during = rows["fsdp"]
    assert during["largest_unit_bytes"] == max(unit["full_bytes"] for unit in during["units"]) > 0
    assert during["step_formula"] == pytest.approx(during["formula"]["total"] + during["largest_unit_bytes"])
    assert during["step_peak_rank0"]["total"] >= during["step_formula"] * 0.99
    assert during["step_peak_max"] >= during["step_peak_rank0"]["total"]
    assert during["step_peak_over_formula"] == pytest.approx(during["step_peak_rank0"]["total"] / during["step_formula"])
    for text in ("4 Psi + 12 Psi/N", "16 Psi/N", "counted/formula", "fsdp during a step", "fsdp units"):
        assert text in stdout


def test_the_real_run_refuses_a_model_under_25m_parameters(capsys):
    assert cli.main(["bench", "strategies", "--model", "cnn"]) == 2
    assert "needs >= 25M" in capsys.readouterr().err


def test_formula_is_zero_for_fp32_adam():
    assert strategies.formula("ddp", 10, 4)["total"] == 160
    assert strategies.formula("zero1", 10, 4)["total"] == 80 + 20
    assert strategies.formula("zero2", 10, 4)["total"] == 40 + 30
    assert strategies.formula("fsdp", 10, 4)["total"] == 40

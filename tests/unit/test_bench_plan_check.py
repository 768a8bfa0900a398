"""hvdtrain bench plan without a launch: the calibration arithmetic, the worker's layout strings, the
table and the verdict (on made-up timings)."""
import argparse
import json

import pytest

from hvdtrain import planner
from hvdtrain.bench.plan import driver as plan_check, worker as plan_check_worker
from hvdtrain.planner.network import CALIBRATION, ring_bandwidth_s, ring_latency_s

SHAPE = planner.ModelShape(layers=2, d_model=32, seq_len=8, vocab=11, heads=4)


def args(**overrides):
    parser = argparse.ArgumentParser()
    plan_check.add_arguments(parser)
    values = parser.parse_args([])
    values.__dict__.update(layers=2, d_model=32, seq_len=8, vocab=11, heads=4, batch=16, **overrides)
    return values


def test_device_rate_is_plans_flops_over_the_measured_seconds():
    assert plan_check.step_flops(1e6, 16, 64) == 6 * 1e6 * 16 * 64
    assert plan_check.device_rate(1e6, 16, 64, 0.5) == pytest.approx(2 * 6 * 1e6 * 16 * 64)


def test_fit_link_reads_plans_ring_terms_backwards():
    bandwidth, alpha, workers = 4e9, 200e-6, 4
    sizes = [4096, 65536, 1 << 20, 4 << 20]
    seconds = [ring_bandwidth_s(s, workers, bandwidth) + ring_latency_s(workers, 1, alpha, alpha) for s in sizes]
    fit = plan_check.fit_link(sizes, seconds, workers)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    assert fit.alpha_s == pytest.approx(alpha, rel=1e-6)
    # and plan, given the fitted link, predicts those same times
    link = plan_check.measured_network(fit)
    setup = planner.Setup(SHAPE, 16, 2.0 ** 40, workers, link=link)
    for size, t in zip(sizes, seconds):
        assert planner.allreduce_s(setup, size, workers, 1) == pytest.approx(t, rel=1e-6)


def test_fit_link_refuses_too_little_and_clamps_noise():
    with pytest.raises(ValueError):
        plan_check.fit_link([4096], [1e-3], 4)
    fit = plan_check.fit_link([1, 2], [2e-3, 1e-3], 4)  # falling line: no bandwidth limit, not negative
    assert fit.bandwidth > 1e12 and fit.alpha_s >= 0


def test_layout_strings_round_trip_between_driver_and_worker():
    for layout in planner.layouts(planner.Setup(SHAPE, 16, 2.0 ** 40, 4)):
        parsed = plan_check_worker.parse_layout(plan_check.layout_key(layout))
        assert parsed == {"strategy": layout.strategy, "tensor": layout.tensor, "pipeline": layout.pipeline,
                          "micro_batches": layout.micro_batches}
    with pytest.raises(argparse.ArgumentTypeError):
        plan_check_worker.parse_layout("ddp/2/1")
    worker = plan_check_worker.parse_args(["--out", "x", "--mode", "world", "--layouts", "ddp/1/1/1,ddp/2/1/1"])
    assert [l["tensor"] for l in worker.layout_list] == [1, 2]


def test_worker_args_parse_in_the_worker():
    a = args()
    argv = plan_check.worker_args(a, "world", ["ddp/1/1/1", "zero1/1/1/1"])
    parsed = plan_check_worker.parse_args(["--out", "x", *argv])
    assert (parsed.d_model, parsed.batch, parsed.rounds, parsed.steps) == (32, 16, a.rounds, a.steps)
    assert len(parsed.layout_list) == 2


def test_spearman_and_verdict():
    same = {"a": 1, "b": 2, "c": 3}
    assert plan_check.spearman(same, same) == pytest.approx(1.0)
    assert plan_check.spearman(same, {"a": 3, "b": 2, "c": 1}) == pytest.approx(-1.0)
    assert plan_check.verdict("b", {"a": 1.0, "b": 2.0, "c": 3.0}) == (True, ["a", "b"])
    assert plan_check.verdict("c", {"a": 1.0, "b": 2.0, "c": 3.0}) == (False, ["a", "b"])


def made_up_run(a):
    """Plans under the three calibrations and measured times that reverse plan's order."""
    link = plan_check.measured_network(plan_check.fit_link([4096, 1 << 20], [1e-3, 1.5e-3], 4))
    plans = plan_check.predictions(SHAPE, argparse.Namespace(batch=16, workers=4),
                                   {"one_process": 5e10, "under_load": 2e10}, link)
    order = [plan_check.layout_key(e.layout) for e in plans["B"].fitting]
    measured = {key: [0.010 * (len(order) - i), 0.011 * (len(order) - i)] for i, key in enumerate(order)}
    return plans, measured, order


def test_rows_table_and_verdicts_on_made_up_timings():
    a = args()
    plans, measured, order = made_up_run(a)
    assert set(plans) == {"A", "B", "C"}
    # overlap 0 never predicts faster than plan's overlap, and a slower rate never faster either
    for e in plans["B"].fitting:
        key = plan_check.layout_key(e.layout)
        c = next(x for x in plans["C"].fitting if plan_check.layout_key(x.layout) == key)
        a_ = next(x for x in plans["A"].fitting if plan_check.layout_key(x.layout) == key)
        assert c.step_s >= e.step_s - 1e-12 and a_.step_s <= e.step_s
    rows = plan_check.build_rows(plans, measured)
    assert [r["key"] for r in rows] == order
    assert [r["rank_predicted"] for r in rows] == list(range(1, len(order) + 1))
    assert [r["rank_measured"] for r in rows] == list(range(len(order), 0, -1))
    assert rows[0]["measured_ms"] == pytest.approx(10.5 * len(order))
    assert rows[0]["spread"] == pytest.approx(0.5 / 10.5)
    text = "\n".join(plan_check.table_lines(rows, "title"))
    assert "pred B ms" in text and "rank meas" in text and rows[0]["layout"] in text
    lines, verdicts = plan_check.verdict_lines(plans, rows)
    assert len(lines) == 3 and all("FAILS" in line for line in lines)
    assert verdicts["B"]["spearman"] == pytest.approx(-1.0)
    assert verdicts["B"]["recommended_measured_rank"] == len(order)
    assert not verdicts["B"]["within_noise_of_fastest"]
    json.dumps(verdicts)  # results.json takes it as it is


def test_calibrate_from_worker_results():
    a = args()
    single = {"plain_step_s": {"16": {"step_s": [0.02, 0.03, 0.04], "update_s": [0.004, 0.005, 0.009]}}}
    world = {"local_step_s": [0.05, 0.06, 0.07], "local_update_s": [0.01, 0.02, 0.03], "local_batch": 4,
             "allreduce_s": {"4096": [1e-3, 1e-3], "1048576": [1.5e-3, 1.5e-3]}}
    cal = plan_check.calibrate(SHAPE, a, single, world)
    # Compute is the step less its update (medians); the update streams 28 bytes per parameter (Adam).
    assert cal["rates"]["one_process"] == pytest.approx(6 * SHAPE.total * 16 * 8 / (0.03 - 0.005))
    assert cal["rates"]["under_load"] == pytest.approx(6 * SHAPE.total * 4 * 8 / (0.06 - 0.02))
    assert cal["update_bandwidths"]["one_process"] == pytest.approx(SHAPE.total * 28 / 0.005)
    assert cal["update_bandwidths"]["under_load"] == pytest.approx(SHAPE.total * 28 / 0.02)
    assert list(cal["allreduce_median_s"]) == ["4096", "1048576"]
    lines = plan_check.calibration_lines(cal, a, cpus=2)
    assert lines[0].endswith("4 ranks share 2 cores):") and "of which Adam's update 5.0 ms" in lines[1]
    # The measured update bandwidth reaches plan: a slower update, a slower predicted step.
    link = plan_check.measured_network(plan_check.fit_link([4096, 1 << 20], [1e-3, 1.5e-3], 4))
    fast = plan_check.predictions(SHAPE, a, cal["rates"], link, {"one_process": 1e12, "under_load": 1e12})
    slow = plan_check.predictions(SHAPE, a, cal["rates"], link, cal["update_bandwidths"])
    assert all(s.step_s > f.step_s for f, s in zip(fast["B"].fitting, sorted(
        slow["B"].fitting, key=lambda e: [x.layout for x in fast["B"].fitting].index(e.layout))))


def test_plan_setup_defaults_unchanged_by_the_link_option():
    setup = planner.Setup(SHAPE, 16, 2.0 ** 40, 4)
    assert setup.link is None and setup.calibration == CALIBRATION

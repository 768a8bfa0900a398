"""hvdtrain.bench.model_parallel.driver: the theory and the accounting, the driver's reading of a worker's
result, and one small pipeline job whose figures must be present and sane."""
import json
import shutil
import subprocess
import sys

import pytest

from hvdtrain.bench.model_parallel import driver as mp
from hvdtrain.examples.textlm import TinyTransformerLM

DIMS = {"vocab": 40, "seq_len": 8, "d_model": 16, "layers": 4, "heads": 4}


def test_the_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    assert mp.bubble_theory(2, 1) == 0.5
    assert mp.bubble_theory(2, 8) == pytest.approx(1 / 9)
    assert mp.bubble_theory(4, 4) == pytest.approx(3 / 7)
    assert mp.bubble_theory(1, 4) == 0.0


def test_gpipe_holds_every_micro_batch_and_1f1b_at_most_p_minus_stage():
    assert [mp.in_flight_theory("gpipe", 8, 4, s) for s in range(4)] == [8, 8, 8, 8]
    assert [mp.in_flight_theory("1f1b", 8, 4, s) for s in range(4)] == [4, 3, 2, 1]
    assert [mp.in_flight_theory("1f1b", 2, 4, s) for s in range(4)] == [2, 2, 2, 1]
    with pytest.raises(ValueError):
        mp.in_flight_theory("zb", 2, 2, 0)


def test_tensor_bytes_are_four_all_reduces_per_block_of_batch_x_seq_x_width():
    assert mp.tensor_bytes_formula(DIMS, batch=3) == 4 * 4 * 3 * 8 * 16 * 4


def test_model_bytes_match_the_real_models_parameters():
    model = TinyTransformerLM(DIMS["vocab"], seq_len=DIMS["seq_len"], d_model=DIMS["d_model"],
                              layers=DIMS["layers"], heads=DIMS["heads"])
    assert mp.model_bytes(DIMS) == sum(p.numel() * p.element_size() for p in model.parameters())  # tied once


def test_the_accounted_bytes_of_a_whole_model_are_the_model():
    everything = range(DIMS["layers"] + 2)
    account = mp.rank_bytes(DIMS, tensor=1, stages=1, held=everything)
    assert account["accounted"] == account["ideal"] == mp.model_bytes(DIMS)
    assert account["replicated"] == account["tied"] == account["stage_balance"] == 0


@pytest.mark.parametrize("tensor,plan", [(2, [[0, 1, 2, 3, 4, 5]]), (1, [[0, 1, 2], [3, 4, 5]]),
                                          (2, [[0, 1, 2], [3, 4, 5]]), (4, [[0, 1, 2, 3, 4, 5]]),
                                          (1, [[0, 1], [2], [3], [4, 5]])])
def test_the_differences_from_model_over_t_x_p_add_up(tensor, plan):
    stages = len(plan)
    accounts = [mp.rank_bytes(DIMS, tensor, stages, held) for held in plan]
    for a in accounts:
        assert a["accounted"] - a["ideal"] == pytest.approx(a["replicated"] + a["tied"] + a["stage_balance"])
    # Over the whole mesh: the model, plus the replicated parts T times, plus the tied copy.
    token = DIMS["vocab"] * DIMS["d_model"] * 4
    assert sum(a["accounted"] for a in accounts) * tensor == pytest.approx(
        mp.model_bytes(DIMS) + sum(a["replicated"] for a in accounts) * tensor + (token * tensor if stages > 1 else 0))
    assert sum(a["stage_balance"] for a in accounts) == pytest.approx(0)
    assert [a["tied"] > 0 for a in accounts] == [False] * (stages - 1) + [stages > 1]


def _pipeline_result():
    # per step: [wall s, compute s, wait s, max in flight]
    steps0 = {"gpipe/1": [[1.0, 0.5, 0.5, 1], [1.0, 0.4, 0.6, 1], [1.0, 0.6, 0.4, 1]],
              "1f1b/1": [[1.0, 0.5, 0.5, 1]] * 3, "gpipe/4": [[1.0, 0.8, 0.2, 4]] * 3,
              "1f1b/4": [[1.0, 0.75, 0.25, 2]] * 3}
    steps1 = {key: [[w, c, wait, 1 if key.startswith("1f1b") else n] for w, c, wait, n in v]
              for key, v in steps0.items()}
    return {"mode": "pipeline", "np": 2, "pipeline": 2, "cpus": 2, "dims": DIMS, "batch": 8,
            "per_rank": [{"rank": 1, "stage": 1, "layers": [3, 4, 5], "steps": steps1},
                         {"rank": 0, "stage": 0, "layers": [0, 1, 2], "steps": steps0}]}


def test_the_driver_reads_the_pipeline_workers_steps():
    rows = mp.pipeline_rows(_pipeline_result())
    assert [(r["micro_batches"], r["stage"]) for r in rows] == [(1, 0), (1, 1), (4, 0), (4, 1)]
    first = rows[0]
    assert first["theory"] == 0.5 and not first["oversubscribed"]
    assert first["gpipe"]["idle"] == pytest.approx(0.5)
    assert (first["gpipe"]["idle_min"], first["gpipe"]["idle_max"]) == pytest.approx((0.4, 0.6))
    assert rows[2]["gpipe"]["idle"] == pytest.approx(0.2) and rows[2]["1f1b"]["idle"] == pytest.approx(0.25)
    assert rows[2]["gpipe"]["max_in_flight"] == 4 and rows[2]["1f1b"]["max_in_flight"] == 2
    assert rows[3]["1f1b"]["in_flight_theory"] == 1
    text = "\n".join(mp.pipeline_table(rows, DIMS, 8))
    assert "P=2 on 2 ranks" in text and "OVERSUBSCRIBED" not in text
    assert "emb+b0+b1" in text and "b2+b3+head" in text


def test_the_driver_labels_a_pipeline_with_more_ranks_than_cores_oversubscribed():
    result = {**_pipeline_result(), "cpus": 1}
    rows = mp.pipeline_rows(result)
    assert rows[0]["oversubscribed"]
    assert "OVERSUBSCRIBED" in "\n".join(mp.pipeline_table(rows, DIMS, 8))


def test_the_driver_reads_the_tensor_workers_steps():
    split = [[0.2, 0.05, 16384, 16]] * 3
    result = {"mode": "tensor", "np": 2, "tensor": 2, "dims": DIMS, "batch": 2,
              "per_rank": [{"rank": r, "steps": {"tensor": split, "whole": [[0.3, 0.0, 0, 0]] * 3,
                                                 "isolated": [[0.02, 0.02, 16384, 16]] * 3}} for r in (1, 0)]}
    summary = mp.tensor_summary(result)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    rank = summary["ranks"][0]
    assert rank["share"] == pytest.approx(0.25) and rank["isolated_share"] == pytest.approx(0.1)
    assert rank["speedup"] == pytest.approx(1.5) and rank["calls"] == 16
    assert summary["bytes_formula"] == 4 * 4 * 2 * 8 * 16 * 4 == rank["bytes"]
    assert "16 (16)" in "\n".join(mp.tensor_table(summary))


def test_the_driver_accounts_for_every_ranks_parameter_bytes():
    full = mp.model_bytes(DIMS)
    first = mp.rank_bytes(DIMS, 1, 2, [0, 1, 2])["accounted"]
    result = {"mode": "memory", "np": 4, "dims": DIMS, "layouts": [
        {"tensor": 1, "pipeline": 1, "per_rank": [{"rank": r, "coordinates": [r, 0, 0], "layers": list(range(6)),
                                                    "parameters": full} for r in range(4)]},
        {"tensor": 1, "pipeline": 2, "per_rank": [
            {"rank": r, "coordinates": [r // 2, r % 2, 0], "layers": [[0, 1, 2], [3, 4, 5]][r % 2],
             "parameters": mp.rank_bytes(DIMS, 1, 2, [[0, 1, 2], [3, 4, 5]][r % 2])["accounted"]}
            for r in range(4)]}]}
    rows = mp.memory_rows(result)
    assert [(r["tensor"], r["pipeline"], r["data"], r["stage"]) for r in rows] == [
        (1, 1, 4, 0), (1, 2, 2, 0), (1, 2, 2, 1)]
    assert all(r["measured"] == r["accounted"] and r["replicas_agree"] for r in rows)
    assert rows[1]["measured"] == first
    text = "\n".join(mp.memory_table(rows, DIMS, 4))
    assert "ddp" in text and "P=2" in text


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")
def test_a_small_pipeline_job_measures_sane_figures(tmp_path):
    """One 2-rank job, a tiny model: every configuration measured, idle shares in (0, 1), and the
    micro-batches held at once exactly the schedules' (GPipe M, 1F1B min(M, P - stage))."""
    args = ["--stages", "2", "--micro-batches", "1,4", "--tensor", "0", "--memory-workers", "0", "--variants", "",
            "--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--vocab", "32", "--batch", "8",
            "--rounds", "1", "--steps", "2", "--warmup", "1", "--timeout", "50", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "hvdtrain.bench.model_parallel.driver", *args], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    figures = json.loads((tmp_path / "results.json").read_text())
    rows = figures["pipeline"][0]
    assert sorted((r["micro_batches"], r["stage"]) for r in rows) == [(1, 0), (1, 1), (4, 0), (4, 1)]
    for row in rows:
        for schedule in ("gpipe", "1f1b"):
            got = row[schedule]
            assert got["steps"] == 2 and 0 < got["idle"] < 1 and got["step_ms"] > 0
            expected = row["micro_batches"] if schedule == "gpipe" else min(row["micro_batches"], 2 - row["stage"])
            assert got["max_in_flight"] == got["in_flight_theory"] == expected
    assert (tmp_path / "bubble.png").stat().st_size > 0
    assert "Pipeline bubble, P=2" in done.stdout


def test_the_driver_reads_the_schedules_workers_steps():
    """Idle = wait / wall per stage beside (P-1)/(v*M+P-1), and zb-h1's wait over 1f1b's at the same M."""
    def steps(wait):
        return [[1.0, 0.5, wait, 2], [1.0, 0.5, wait, 2]]
    result = {"pipeline": 2, "cpus": 2, "per_rank": [
        {"rank": r, "stage": r, "steps": {"1f1b/4": steps(0.3), "1f1b:v2/4": steps(0.2), "zb-h1/4": steps(0.1)}}
        for r in (0, 1)]}
    rows = {(r["variant"], r["stage"]): r for r in mp.schedule_rows(result)}
    assert rows[("1f1b", 0)]["formula"] == pytest.approx(1 / 5)
    assert rows[("1f1b:v2", 1)]["formula"] == pytest.approx(1 / 9)
    assert rows[("zb-h1", 0)]["formula"] == pytest.approx(1 / 13)
    assert rows[("1f1b:v2", 1)]["idle"] == pytest.approx(0.2)
    assert rows[("1f1b:v2", 1)]["ratio"] == pytest.approx(0.2 * 9)
    assert rows[("zb-h1", 1)]["versus_1f1b"] == pytest.approx(1 / 3)
    assert rows[("1f1b", 1)]["versus_1f1b"] is None
    assert "zb-h1" in "\n".join(mp.schedule_table(list(rows.values())))


def test_a_small_schedules_job_measures_every_variant(tmp_path):
    """One 2-rank job: every schedule variant measured at M = 2 on both stages, idle fractions in [0, 1)."""
    args = ["--stages", "2", "--micro-batches", "2", "--tensor", "0", "--memory-workers", "0",
            "--d-model", "32", "--layers", "2", "--heads", "2", "--seq-len", "16", "--vocab", "32", "--batch", "8",
            "--rounds", "1", "--steps", "2", "--warmup", "1", "--timeout", "100", "--out", str(tmp_path)]
    done = subprocess.run([sys.executable, "-m", "hvdtrain.bench.model_parallel.driver", *args], capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((tmp_path / "results.json").read_text())["schedules"][0]
    assert sorted((r["variant"], r["stage"]) for r in rows) == [
        ("1f1b", 0), ("1f1b", 1), ("1f1b:v2", 0), ("1f1b:v2", 1), ("zb-h1", 0), ("zb-h1", 1)]
    for row in rows:
        assert row["steps"] == 2 and 0 <= row["idle"] < 1 and row["step_ms"] > 0 and row["formula"] > 0
    assert "Pipeline schedules, P=2" in done.stdout

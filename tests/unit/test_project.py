import json
import subprocess
import sys

import pytest

from hvdtrain import cli

from hvdtrain.planner import projection as project
from hvdtrain.planner.network import (CALIBRATION, LABEL, NETWORKS, Calibration, Network, expected_max_normal,
                                      ring_bandwidth_s, ring_latency_s)
from hvdtrain.planner.projection import ANCHORS, Workload, calibrate, predict

RESNET = project.model_workload("resnet101")


@pytest.fixture(scope="module")
def validation():
    return project.validate()


def test_one_worker_has_no_communication_and_efficiency_one():
    result = predict(RESNET, 1, NETWORKS["10gbe"])
    assert result.efficiency == 1.0
    assert result.comm_s == result.exposed_s == result.straggler_s == 0.0
    assert result.samples_per_s == pytest.approx(RESNET.batch / RESNET.compute_s)


def test_ring_terms_match_a_hand_computed_case():
    # 100 MB over 4 workers at 1 GB/s: 2 * 3/4 * 0.1 s.
    assert ring_bandwidth_s(100e6, 4, 1e9) == pytest.approx(0.15)
    # 4 nodes of one GPU: 6 network steps; NCCL's base 8.4 us and plateau x1.9.
    assert ring_latency_s(4, 4, 10e-6, 5e-6) == pytest.approx(1.9 * (8.4e-6 + 6 * 10e-6))
    # one node of 4 GPUs: 6 intra-node steps, no plateau; 2 nodes of 2: 2 network + 4 intra steps.
    assert ring_latency_s(4, 1, 10e-6, 5e-6) == pytest.approx(8.4e-6 + 6 * 5e-6)
    assert ring_latency_s(4, 2, 10e-6, 5e-6) == pytest.approx(1.9 * (8.4e-6 + 2 * 10e-6 + 4 * 5e-6))


def test_predict_matches_a_hand_computed_step():
    work = Workload(params=25e6, compute_s=0.1)                      # 100 MB of fp32 gradients: one buffer
    result = predict(work, 4, NETWORKS["25roce"], calibration=Calibration(0.5, 0.0, 1.0))
    bandwidth = 1.5 * 100e6 / (25e9 / 8 * 0.96)                      # 0.05 s
    latency = 1.9 * (8.4e-6 + 6 * 9.6e-6)
    assert result.bandwidth_s == pytest.approx(bandwidth)
    assert result.latency_s == pytest.approx(latency)
    assert result.hidden_s == pytest.approx(0.5 * (bandwidth + latency))
    assert result.step_s == pytest.approx(0.1 + 0.5 * (bandwidth + latency))
    assert result.efficiency == pytest.approx(0.1 / result.step_s)
    assert result.comm_share == pytest.approx(result.exposed_s / result.step_s)


def test_each_nic_carries_the_whole_ring_and_the_slower_link_bounds_it():
    shared = predict(RESNET, 64, NETWORKS["25gbe"], gpus_per_node=8)
    alone = predict(RESNET, 64, NETWORKS["25gbe"], gpus_per_node=1)
    assert shared.bandwidth_s == pytest.approx(alone.bandwidth_s)
    # 200 Gb/s HDR is faster than PCIe 3 (126 Gb/s nominal): the PCIe hops bound the ring.
    hdr = predict(RESNET, 64, NETWORKS["ib-hdr"], gpus_per_node=8, intra=NETWORKS["pcie3"])
    assert hdr.bandwidth_s == pytest.approx(ring_bandwidth_s(RESNET.grad_bytes, 64, 126e9 / 8 * 0.8))
    inside = predict(RESNET, 8, NETWORKS["25gbe"], gpus_per_node=8, intra=NETWORKS["nvlink"])
    assert inside.nodes == 1 and inside.efficiency > shared.efficiency


def test_efficiency_falls_with_workers_and_model_size_and_rises_with_bandwidth():
    workers = [2 ** i for i in range(11)]
    for name in ("10gbe", "25gbe", "ib-hdr", "nvlink"):
        curve = [predict(RESNET, p, NETWORKS[name], gpus_per_node=4).efficiency for p in workers]
        assert all(a > b for a, b in zip(curve, curve[1:])), name
    sizes = [predict(Workload(n, 0.3), 64, NETWORKS["25gbe"]).efficiency for n in (5e6, 25e6, 100e6, 400e6)]
    assert all(a > b for a, b in zip(sizes, sizes[1:]))
    speeds = [predict(RESNET, 256, NETWORKS[n], gpus_per_node=4).efficiency
              for n in ("10gbe", "25gbe", "100gbe", "ib-hdr")]
    assert all(a < b for a, b in zip(speeds, speeds[1:]))
    assert predict(RESNET, 128, NETWORKS["25gbe"]).efficiency < predict(RESNET, 128, NETWORKS["25roce"]).efficiency


def test_fp16_halves_the_bandwidth_term_only():
    fp32 = predict(Workload(25e6, 0.2, bytes_per_param=4), 32, NETWORKS["25gbe"], fusion_bytes=1e9)
    fp16 = predict(Workload(25e6, 0.2, bytes_per_param=2), 32, NETWORKS["25gbe"], fusion_bytes=1e9)
    assert fp16.bandwidth_s == pytest.approx(fp32.bandwidth_s / 2)
    assert fp16.latency_s == pytest.approx(fp32.latency_s)
    assert fp16.efficiency > fp32.efficiency


def test_expected_maximum_of_normals():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(0.5642, abs=0.03)    # exact: 1/sqrt(pi)
    assert expected_max_normal(1000) == pytest.approx(3.241, abs=0.03)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError):
        Workload(params=0, compute_s=0.1)
    with pytest.raises(ValueError):
        Network("x", 25, 10.0, "tcp", efficiency=1.5)
    with pytest.raises(ValueError):
        predict(RESNET, 0, NETWORKS["25gbe"])


def test_stored_calibration_is_what_the_fit_returns():
    fitted = calibrate()
    assert fitted.overlap == pytest.approx(CALIBRATION.overlap, abs=1e-9)
    assert fitted.jitter == pytest.approx(CALIBRATION.jitter, abs=1e-9)
    assert fitted.tcp_efficiency == pytest.approx(CALIBRATION.tcp_efficiency, abs=1e-9)


def test_validation_error_is_within_the_claimed_bounds(validation):
    # Claimed in the report: in-sample |error| <= 3.5 points, leave-one-out <= 6 points, on every anchor.
    assert len(validation) == len(ANCHORS) == 8
    for row in validation:
        assert row["error_pp"] == pytest.approx(row["projected_pct"] - row["published_pct"])
        assert abs(row["error_pp"]) <= 3.5, row
        assert abs(row["loo_error_pp"]) <= 6.0, row


def test_cli_writes_a_labelled_table_json_and_png(tmp_path, capsys):
    out = tmp_path / "proj"
    code = cli.main(["bench", "project", "--model", "resnet101", "--network", "25gbe,ib-hdr", "--gpus-per-node", "4",
                         "--workers", "1,8,128", "--out", str(out)])
    assert code == 0
    text = capsys.readouterr().out
    assert text.count(LABEL) == 2 and "efficiency %" in text and "comm share %" in text
    payload = json.loads((out / "results.json").read_text())
    assert payload["label"] == LABEL
    rows = payload["networks"]["25gbe"]
    assert [r["workers"] for r in rows] == [1, 8, 128] and all(r["label"] == LABEL for r in rows)
    assert rows[0]["efficiency"] == 1.0 and 0 < rows[2]["efficiency"] < rows[1]["efficiency"] < 1
    assert (out / "efficiency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_validate_prints_published_against_projected(tmp_path, capsys):
    assert cli.main(["bench", "project", "--validate", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert f"{LABEL} vs published" in text and "LOO error pp" in text
    assert len(json.loads((tmp_path / "results.json").read_text())["validation"]) == len(ANCHORS)
    assert (tmp_path / "efficiency.png").exists()


def test_cli_refuses_an_incomplete_workload(tmp_path, capsys):
    assert cli.main(["bench", "project", "--params", "25e6", "--out", str(tmp_path)]) == 2
    assert "--compute-ms" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_the_model_does_not_import_torch():
    code = "import sys, hvdtrain.planner.projection, hvdtrain.bench.projection.driver; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

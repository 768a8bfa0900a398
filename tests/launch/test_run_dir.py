"""What a user finds after a run: the run directory, its files, the timeline and the plots."""
import json

import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.launch.helpers import BIN, PYTHON, run

EPOCHS = 2


def test_a_two_worker_run_leaves_config_metrics_events_logs_timeline_and_plots(tmp_path):
    code, out, err = run(["horovodrun", "-np", "2", PYTHON, "train.py", f"--train.epochs={EPOCHS}",
                          f"--train.run_dir={tmp_path}", "--train.run_name=demo", "--train.timeline_steps=5",
                          "--model.hidden=64"])
    assert code == 0, out[-3000:] + err[-3000:]
    run_dir = tmp_path / "demo"
    names = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*") if p.is_file())
    assert names[:6] == ["config.yaml", "horovod-timeline.json", "logs/rank-0.log", "logs/rank-1.log",
                         "metrics.jsonl", "model.safetensors"], names
    assert len(names) == 7 and names[6].startswith("tensorboard/events.out.tfevents.")

    # The resolved settings, including the overrides, printed once and saved.
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["epochs"] == EPOCHS and config["model"]["hidden"] == 64
    assert out.count("settings:") == 1

    # stdout is a pipe here, as in a SLURM job: log lines, no progress bar's carriage returns.
    assert "\r" not in out and "waiting for gradients, ETA" in out

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    epochs = [r for r in records if r["kind"] == "epoch"]
    steps = [r for r in records if r["kind"] == "step"]
    assert [r["epoch"] for r in epochs] == [1.0, 2.0]
    assert all(0 < r["val_accuracy"] <= 1 and r["samples_per_sec"] > 0 for r in epochs)
    assert steps and all(r["loss"] > 0 and 0 <= r["comm_fraction"] <= 1 and r["lr"] > 0 for r in steps)
    assert [r["step"] for r in steps] == sorted(r["step"] for r in steps)

    events = EventAccumulator(str(next((run_dir / "tensorboard").iterdir()).parent)).Reload()
    assert {"step/loss", "epoch/val_accuracy"} <= set(events.Tags()["scalars"])
    assert len(events.Scalars("epoch/val_accuracy")) == EPOCHS

    # Rank 1 kept its own INFO lines, stamped with its rank and host.
    assert " rank 1@" in (run_dir / "logs" / "rank-1.log").read_text()

    trace = json.loads((run_dir / "horovod-timeline.json").read_text())  # closed: valid JSON
    assert any(e.get("name", "").startswith("NEGOTIATE_ALLREDUCE") for e in trace)
    assert f"Horovod timeline of steps 6-10 written to {run_dir / 'horovod-timeline.json'}" in out

    code, plot_out, plot_err = run([str(BIN / "hvdtrain"), "plot", str(run_dir)], timeout=120)
    assert code == 0, plot_err
    for name in ("loss.png", "accuracy.png", "throughput.png"):
        png = run_dir / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and str(png) in plot_out

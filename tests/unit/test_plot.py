"""``hvdtrain plot``: metrics.jsonl parsing (dedup, restarts, bad lines) and the PNGs it writes."""
import argparse
import json

from hvdtrain.cli import plot as plot_command
from hvdtrain.observability import plots as plot

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_700_000_000.0


def step(n, elapsed, loss=None, **extra):
    return {"kind": "step", "time": T0 + elapsed, "elapsed": elapsed, "step": n, "epoch": n / 100,
            "loss": 2.0 / (1 + n / 50) if loss is None else loss, "lr": 0.1, "samples_per_sec": 5000.0 + n,
            "comm_fraction": 0.2, **extra}


def epoch(n, elapsed, validation=True):
    record = {"kind": "epoch", "time": T0 + elapsed, "elapsed": elapsed, "step": n, "epoch": n / 100,
              "train_loss": 2.0 / (1 + n / 50), "samples_per_sec": 5000.0, "lr": 0.1}
    if validation:
        record.update(val_loss=2.2 / (1 + n / 50), val_accuracy=0.5 + n / 1000)
    return record


def run_records(validation=True):
    """Three epochs of 100 steps, a step record every 10 steps and one epoch record per epoch."""
    records = []
    for n in range(10, 301, 10):
        records.append(step(n, elapsed=n * 0.5))
        if n % 100 == 0:
            records.append(epoch(n, elapsed=n * 0.5 + 2, validation=validation))
    return records


def write_run(tmp_path, records, tail=""):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [json.dumps(r) if isinstance(r, dict) else r for r in records]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    return run_dir


def plot_args(run_dir, out=None):
    parser = argparse.ArgumentParser()
    plot_command.add_arguments(parser)
    return parser.parse_args([str(run_dir)] + (["--out", str(out)] if out else []))


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes"


def test_a_run_with_validation_gets_all_three_plots_and_their_paths_printed(tmp_path, capsys):
    run_dir = write_run(tmp_path, run_records())
    assert plot_command.run(plot_args(run_dir)) == 0
    names = ["loss.png", "accuracy.png", "throughput.png"]
    for name in names:
        assert_png(run_dir / "plots" / name)
    assert capsys.readouterr().out.splitlines() == [str(run_dir / "plots" / name) for name in names]


def test_without_validation_accuracy_is_skipped_with_a_message(tmp_path, capsys):
    run_dir = write_run(tmp_path, run_records(validation=False))
    assert plot_command.run(plot_args(run_dir, out=tmp_path / "figures")) == 0
    out, err = capsys.readouterr()
    assert out.splitlines() == [str(tmp_path / "figures" / n) for n in ("loss.png", "throughput.png")]
    assert "no validation accuracy" in err and "accuracy.png not written" in err
    assert not (tmp_path / "figures" / "accuracy.png").exists()
    assert not (run_dir / "plots").exists()
    assert_png(tmp_path / "figures" / "loss.png")


def test_a_truncated_last_line_is_reported_with_its_number_and_skipped(tmp_path, capsys):
    records = run_records()
    run_dir = write_run(tmp_path, records, tail='{"kind": "step", "time": 17000')
    steps, epochs = plot.load_metrics(run_dir)
    assert f"metrics.jsonl:{len(records) + 1}: not valid JSON, skipped" in capsys.readouterr().err
    assert (len(steps), len(epochs)) == (30, 3)
    assert plot_command.run(plot_args(run_dir)) == 0
    assert_png(run_dir / "plots" / "throughput.png")


def test_a_record_missing_a_required_key_is_reported_and_skipped(tmp_path, capsys):
    broken = {k: v for k, v in step(5, elapsed=2).items() if k != "loss"}
    run_dir = write_run(tmp_path, [step(1, elapsed=1), broken, step(10, elapsed=3)])
    steps, _ = plot.load_metrics(run_dir)
    assert [r["step"] for r in steps] == [1, 10]
    assert "metrics.jsonl:2: step record without a number for loss, skipped" in capsys.readouterr().err


def test_null_values_are_kept_as_gaps_not_reported(tmp_path, capsys):
    # The trainer writes a non-finite number (a diverged loss) as null.
    records = run_records()
    records[3]["loss"] = None
    records[10].update(val_loss=None, val_accuracy=None)  # the first epoch record
    run_dir = write_run(tmp_path, records)
    steps, epochs = plot.load_metrics(run_dir)
    assert len(steps) == 30 and steps[3]["loss"] != steps[3]["loss"]  # NaN
    assert plot_command.run(plot_args(run_dir)) == 0
    assert capsys.readouterr().err == ""
    assert_png(run_dir / "plots" / "accuracy.png")


def test_an_epoch_without_a_train_loss_is_kept_and_plots(tmp_path, capsys):
    # Horovod elastic can roll back to a commit at an epoch's last step: that epoch ends with no
    # step, and no train loss, of its own.
    records = run_records()
    del records[21]["train_loss"]  # the second epoch record
    run_dir = write_run(tmp_path, records)
    _, epochs = plot.load_metrics(run_dir)
    assert [r["step"] for r in epochs] == [100, 200, 300]
    assert plot_command.run(plot_args(run_dir)) == 0
    assert capsys.readouterr().err == ""
    assert_png(run_dir / "plots" / "loss.png")


def test_unknown_keys_and_kinds_are_ignored(tmp_path):
    records = [step(10, elapsed=5, grad_norm=1.5), {"kind": "profile", "step": 10, "whatever": [1, 2]},
               epoch(10, elapsed=6)]
    steps, epochs = plot.load_metrics(write_run(tmp_path, records))
    assert steps[0]["grad_norm"] == 1.5 and [r["step"] for r in steps + epochs] == [10, 10]


def test_a_resumed_run_keeps_the_later_record_of_each_step_and_marks_the_restart(tmp_path):
    # Checkpoint at step 20; crash after step 40; the new process re-does 30 and 40 (its clock goes on).
    first = [step(10, elapsed=5, loss=1.0), step(20, elapsed=10, loss=0.9), step(30, elapsed=15, loss=0.8),
             step(40, elapsed=20, loss=0.7)]
    second = [step(30, elapsed=90, loss=0.6), step(40, elapsed=95, loss=0.5), step(50, elapsed=100, loss=0.4)]
    steps, _ = plot.load_metrics(write_run(tmp_path, first + second))
    assert [(r["step"], r["loss"]) for r in steps] == [(10, 1.0), (20, 0.9), (30, 0.6), (40, 0.5), (50, 0.4)]
    assert [r["step"] for r in steps if r.get(plot.RESTART)] == [30]


def test_a_restart_is_marked_even_when_no_step_repeats(tmp_path):
    # The checkpoint was at the last logged step: only the reset clock shows the new process.
    records = [step(10, elapsed=5), step(20, elapsed=10), dict(step(30, elapsed=4), time=T0 + 60)]
    steps, _ = plot.load_metrics(write_run(tmp_path, records))
    assert [r["step"] for r in steps if r.get(plot.RESTART)] == [30]


def test_a_resumed_run_plots(tmp_path):
    records = run_records()[:12] + [dict(r, time=r["time"] + 600) for r in run_records()[8:]]
    run_dir = write_run(tmp_path, records)
    assert plot_command.run(plot_args(run_dir)) == 0
    assert_png(run_dir / "plots" / "throughput.png")


def test_an_empty_directory_exits_2_saying_what_to_do(tmp_path, capsys):
    assert plot_command.run(plot_args(tmp_path)) == 2
    err = capsys.readouterr().err
    assert f"no metrics.jsonl in {tmp_path}" in err and "train.run_dir" in err
    assert not (tmp_path / "plots").exists()


def test_an_empty_file_and_a_missing_directory_exit_2(tmp_path, capsys):
    run_dir = write_run(tmp_path, [], tail="")
    assert plot_command.run(plot_args(run_dir)) == 2
    assert "holds no step or epoch records yet" in capsys.readouterr().err
    assert plot_command.run(plot_args(tmp_path / "nowhere")) == 2
    assert f"no directory {tmp_path / 'nowhere'}" in capsys.readouterr().err

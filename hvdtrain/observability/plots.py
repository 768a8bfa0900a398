"""A run's metrics.jsonl read back (a resumed run's later record of a step wins) and drawn as PNGs:
loss, validation accuracy, throughput. No torch or Horovod: it runs anywhere matplotlib does.
The command is hvdtrain.cli.plot."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from hvdtrain.observability.figures import new_figure, save_figure
from hvdtrain.observability.metric_sinks import METRICS_FILE

RESTART = "_restart"  # set by load_metrics on the first step record after a restart
# An epoch record may lack train_loss: under Horovod elastic an epoch can end with no step of its own.
REQUIRED = {"step": ("step", "time", "loss", "samples_per_sec"), "epoch": ("step", "epoch")}
FINITE = ("step", "time", "epoch")  # the axes; a null loss (the trainer writes NaN as null) plots as a gap

Record = Dict[str, object]


class MetricsError(Exception):
    """The run directory has nothing to plot; the message says what to do."""


def load_metrics(run_dir) -> Tuple[List[Record], List[Record]]:
    """(step records, epoch records), each sorted by step, one record per step: the later one wins.

    Lines that are not JSON or lack a number for a required key are reported with their line number and
    skipped (a run killed mid-write leaves a truncated last line); unknown kinds and keys are ignored,
    and null values become NaN.
    """
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise MetricsError(f"no {METRICS_FILE} in {run_dir}: was the run started with a run directory "
                           f"(train.run_dir)?")
    latest: Dict[str, Dict[int, Record]] = {"step": {}, "epoch": {}}
    previous: Optional[Record] = None
    restarting = False
    with open(path) as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                print(f"hvdtrain plot: {path}:{number}: not valid JSON, skipped", file=sys.stderr)
                continue
            kind = record.get("kind") if isinstance(record, dict) else None
            if kind not in REQUIRED:
                continue
            record = {key: math.nan if value is None else value for key, value in record.items()}
            missing = [key for key in REQUIRED[kind]
                       if not _has(record, key) or (key in FINITE and not math.isfinite(record[key]))]
            if missing:
                print(f"hvdtrain plot: {path}:{number}: {kind} record without a number for "
                      f"{', '.join(missing)}, skipped", file=sys.stderr)
                continue
            if previous is not None and _restarted(previous, record):
                restarting = True
            if restarting and kind == "step":
                record, restarting = {**record, RESTART: True}, False
            latest[kind][record["step"]] = record
            previous = record
    steps, epochs = (sorted(latest[kind].values(), key=lambda r: r["step"]) for kind in ("step", "epoch"))
    if not steps and not epochs:
        raise MetricsError(f"{path} holds no step or epoch records yet: the trainer writes one every "
                           f"train.log_every steps and at the end of each epoch")
    return steps, epochs


def _has(record: Record, key: str) -> bool:
    value = record.get(key)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _restarted(previous: Record, record: Record) -> bool:
    """A new process took over: the step went back or repeated, or the clock since start reset."""
    if record["step"] < previous["step"] or (record["step"], record["kind"]) == (previous["step"], previous["kind"]):
        return True
    return _has(record, "elapsed") and _has(previous, "elapsed") and record["elapsed"] < previous["elapsed"]


def _broken(records: List[Record], x: Callable[[Record], float], y: Callable[[Record], float]):
    """x and y with a NaN before each restart, so the line breaks there instead of bridging the gap."""
    xs: List[float] = []
    ys: List[float] = []
    for record in records:
        if record.get(RESTART) and xs:
            xs.append(math.nan)
            ys.append(math.nan)
        xs.append(x(record))
        ys.append(y(record))
    return xs, ys


def _mark_restarts(ax, xs: List[float]) -> None:
    for i, x in enumerate(xs):
        ax.axvline(x, color="grey", linestyle="--", linewidth=1, label="restart" if i == 0 else None)


def plot_loss(steps: List[Record], epochs: List[Record], out: Path, title: str) -> Path:
    """The loss curves of a run (train per log record, train and validation per epoch) as a PNG at ``out``.

    Args:
        steps: the run's step records.
        epochs: its epoch records.
        out: the image file to write.
        title: the figure's title.
    """
    fig, (ax,) = new_figure(width=7.0)
    if steps:
        ax.plot(*_broken(steps, lambda r: r["step"], lambda r: r["loss"]), linewidth=1, alpha=0.6,
                label="train (per log record)")
    trained = [r for r in epochs if _has(r, "train_loss")]
    if trained:
        ax.plot([r["step"] for r in trained], [r["train_loss"] for r in trained], "o-", label="train (epoch)")
    validated = [r for r in epochs if _has(r, "val_loss")]
    if validated:
        ax.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], "s-", label="validation")
    _mark_restarts(ax, [r["step"] for r in steps if r.get(RESTART)])
    ax.set(title=f"Loss - {title}", xlabel="optimizer step", ylabel="loss (mean per sample)")
    ax.grid(alpha=0.3)
    ax.legend()
    return save_figure(fig, out / "loss.png")


def plot_accuracy(epochs: List[Record], out: Path, title: str) -> Optional[Path]:
    validated = [r for r in epochs if _has(r, "val_accuracy")]
    if not validated:
        return None
    fig, (ax,) = new_figure(width=7.0)
    ax.plot([r["epoch"] for r in validated], [100 * r["val_accuracy"] for r in validated], "s-")
    best = max(validated, key=lambda r: r["val_accuracy"] if math.isfinite(r["val_accuracy"]) else -1)
    ax.set(title=f"Validation accuracy - {title} (best {100 * best['val_accuracy']:.2f}%, "
                 f"epoch {best['epoch']:g})", xlabel="epoch", ylabel="validation accuracy (%)")
    ax.grid(alpha=0.3)
    return save_figure(fig, out / "accuracy.png")


def plot_throughput(steps: List[Record], out: Path, title: str) -> Path:
    """Samples/s against the wall clock (a restart's downtime shows as a gap); the all-reduce wait on the right."""
    start = min(r["time"] for r in steps)
    span = max(r["time"] for r in steps) - start
    unit, scale = ("h", 3600.0) if span > 3 * 3600 else ("min", 60.0) if span > 180 else ("s", 1.0)

    def when(record: Record) -> float:
        return (record["time"] - start) / scale

    fig, (ax,) = new_figure(width=7.0)
    ax.plot(*_broken(steps, when, lambda r: r["samples_per_sec"]), color="tab:blue", label="samples/s")
    ax.set(title=f"Throughput - {title}", xlabel=f"wall time since the first record ({unit})",
           ylabel="samples/s (all ranks)")
    ax.set_ylim(0, 1.3 * max(filter(math.isfinite, (r["samples_per_sec"] for r in steps)), default=0) or 1.0)
    ax.grid(alpha=0.3)
    _mark_restarts(ax, [when(r) for r in steps if r.get(RESTART)])
    handles = list(ax.get_lines())
    timed = [r for r in steps if _has(r, "comm_fraction")]
    if timed:
        comm = ax.twinx()
        handles += comm.plot(*_broken(timed, when, lambda r: 100 * r["comm_fraction"]), color="tab:orange",
                             linestyle=":", label="waiting for gradients (%)")
        comm.set(ylabel="time waiting for gradients (%)", ylim=(0, 100))
    ax.legend(handles=[h for h in handles if not h.get_label().startswith("_")], loc="upper center", ncol=3)
    return save_figure(fig, out / "throughput.png")

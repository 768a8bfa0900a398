"""How benchmark results leave the program: an aligned text table, a JSON file and PNG plots."""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: Optional[str] = None) -> str:
    """A fixed-width table; numbers right-aligned, text left-aligned."""
    cells = [[_cell(value) for value in row] for row in rows]
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    out = ([title] if title else []) + [line(headers), line(["-" * w for w in widths])]
    return "\n".join(out + [line(row) for row in cells])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        magnitude = abs(value)
        if magnitude >= 100:
            return f"{value:.0f}"
        if magnitude >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def machine() -> Dict[str, Any]:
    """What the figures were measured on, stored beside them."""
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_json(path: Path, payload: Dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps({"machine": machine(), **payload}, indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)
    return path


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure on the file-only backend (no display on a cluster node)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def output_dir(base: Optional[str], name: str) -> Path:
    """Where a benchmark writes: ``base`` if given, else bench-results/<name>-<timestamp>."""
    if base:
        return Path(base)
    return Path("bench-results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def print_lines(lines: List[str]) -> None:
    print("\n".join(lines), flush=True)

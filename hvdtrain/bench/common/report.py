"""How benchmark results leave the program: the machine they were measured on, a JSON file, where they go."""
from __future__ import annotations

import json
import math
import os
import platform
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from hvdtrain.common.atomic import write_text_atomically


def machine() -> Dict[str, Any]:
    """What the figures were measured on, stored beside them."""
    return {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "platform": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def write_json(path: Path, payload: Dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps({"machine": machine(), **payload}, indent=2, sort_keys=False) + "\n")
    return path


def output_dir(base: Optional[str], name: str) -> Path:
    """Where a benchmark writes: ``base`` if given, else bench-results/<name>-<timestamp>."""
    if base:
        return Path(base)
    return Path("bench-results") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def print_lines(lines: List[str]) -> None:
    print("\n".join(lines), flush=True)


def finite_or_none(value: Any) -> Any:
    """NaN (not measured) as JSON null, so the file is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value

"""Every causal-LM family of the installed transformers, built tiny, under T=2, P=2, T=2 x P=2 and
fsdp built on the meta device, each under AdamW and plain SGD, against one process in float64
throughout: docs/reference/hf-families.md (the table) and .cache/hf-families.jsonl (every case).

    python scripts/sweep_hf_layouts.py [--families llama,gemma2] [--layouts T2,P2] [--steps 3]
    python scripts/sweep_hf_layouts.py --render-only   # the page again from the .jsonl (and its .meta.json)
    python scripts/sweep_hf_layouts.py --update --families laguna,doge   # re-run these, keep the other rows

One launch per world size runs the families in sequence (hvdtrain.verify.driver); a family that
crashes or hangs is an error and the rest go on. A script, not a CI phase: about 20 minutes on
2 cores. CI runs a slice (tests/launch/test_layout_sweep.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hvdtrain.verify import driver, layouts, table  # noqa: E402
from hvdtrain.verify.outcome import Outcome  # noqa: E402
from hvdtrain.verify.reference import OPTIMIZERS, RATES  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated model types (default: every causal-LM one)")
    parser.add_argument("--layouts", default=",".join(layouts.SWEEP))
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--family-timeout", type=float, default=driver.FAMILY_TIMEOUT)
    parser.add_argument("--launcher", default="horovodrun", choices=("horovodrun", "mpirun"))
    parser.add_argument("--page", type=Path, default=ROOT / "docs/reference/hf-families.md")
    parser.add_argument("--jsonl", type=Path, default=ROOT / ".cache/hf-families.jsonl")
    parser.add_argument("--render-only", action="store_true", help="write the page from --jsonl, run nothing")
    parser.add_argument("--update", action="store_true",
                        help="re-run only --families and replace their rows in --jsonl, keeping every other row "
                             "(the page says which families were re-run at which commit)")
    parser.add_argument("--note", default="", help="a line the page opens with (what state of the code this is)")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    from hvdtrain.verify.tiny import causal_lm_families

    every = causal_lm_families()
    chosen = [f for f in every if not args.families or f.model_type in args.families.split(",")]
    plans = {f.model_type: f.plans for f in chosen}
    wanted = layouts.named(args.layouts)
    started = time.monotonic()
    meta_path = args.jsonl.with_suffix(".meta.json")
    if args.update and not args.families:
        print("--update re-runs the families named by --families; name them (or drop --update for a full sweep)",
              file=sys.stderr)
        return 2
    if args.render_only:
        outcomes = _read(args.jsonl)
        run = json.loads(meta_path.read_text())
    else:
        rerun = {layout.name for layout in wanted}
        kept = ([o for o in _read(args.jsonl) if not (o.family in plans and o.layout in rerun)]
                if args.update else [])
        commit = {"branch": _git("rev-parse", "--abbrev-ref", "HEAD"), "commit": _git("rev-parse", "--short", "HEAD"),
                  "date": datetime.date.today().isoformat()}
        fresh = _sweep(args, list(plans), wanted)
        outcomes = kept + fresh
        args.jsonl.parent.mkdir(parents=True, exist_ok=True)
        args.jsonl.write_text("".join(o.to_json() + "\n" for o in outcomes))
        minutes = round((time.monotonic() - started) / 60, 1)
        if args.update:
            run = json.loads(meta_path.read_text())
            run.setdefault("updates", []).append({**commit, "families": sorted(plans), "layouts": sorted(rerun),
                                                  "minutes": minutes})
        else:
            run = {**commit, "steps": args.steps, "minutes": minutes}
        meta_path.write_text(json.dumps(run))
        plans = {f.model_type: f.plans for f in every if f.model_type in {o.family for o in outcomes}}
        wanted = layouts.named(",".join(sorted({o.layout for o in outcomes}, key=_layout_order)))
    built = {o.family for o in outcomes if o.result != "skipped"}
    header = {**({"note": args.note} if args.note else {}), **_header(run, len(every))}
    page = table.markdown(outcomes, [layout.name for layout in wanted], plans, header, built)
    args.page.write_text(page)
    print(f"{len(outcomes)} cases on the page, {round((time.monotonic() - started) / 60, 1)} min; {args.page}")
    return 0


def _sweep(args: argparse.Namespace, families: list, wanted: list) -> list:
    """Run the families, printing each case as it ends; the outcomes are written once the run ends
    (an interrupted --update leaves the previous .jsonl whole)."""
    def show(outcome: Outcome) -> None:
        print(f"{outcome.family:24s} {outcome.layout:9s} {outcome.optimizer:5s} {outcome.summary()[:110]}", flush=True)

    return driver.run(families, wanted, args.optimizers.split(","), args.steps, family_timeout=args.family_timeout,
                      launcher=args.launcher, log_dir=ROOT / ".cache/hf-families-logs", on_outcome=show)


def _read(path: Path) -> list:
    if not path.exists():
        return []
    return [Outcome.from_json(line) for line in path.read_text().splitlines() if line.strip()]


def _layout_order(name: str) -> int:
    names = list(layouts.SWEEP)
    return names.index(name) if name in names else len(names)


def _header(run: dict, every: int) -> dict:
    import torch
    import transformers

    from hvdtrain.verify import tiny

    return {
        "state of": f"branch `{run['branch']}` at {run['commit']} (re-run `python scripts/sweep_hf_layouts.py` "
                    f"after a change)",
        "date": run["date"],
        "versions": f"transformers {transformers.__version__}, torch {torch.__version__}",
        "families": f"the {every} causal-LM model types of transformers (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)",
        "each case": (f"built tiny from its config class (hidden {tiny.HIDDEN}, {tiny.LAYERS} layers, {tiny.HEADS} "
                      f"heads, {tiny.KV_HEADS} key/value heads, vocabulary {tiny.VOCAB}, 4 experts top-2, dropout "
                      f"0; float64; experts run by transformers' eager loop), {run['steps']} steps of 4 token "
                      f"sequences of {tiny.SEQUENCE} per worker through the Trainer (scale_lr off, no warm-up; "
                      f"AdamW lr {RATES['adamw']}, SGD lr {RATES['sgd']}) against one process on the same global "
                      f"batches, both inside `float64_throughout()`"),
        "equal": "every gathered parameter and each step's loss within 1e-10 of one process (the cell shows "
                 "the largest |diff|)",
        "refused": "hvdtrain raised its own error at set-up or before the first step (the reason, classified "
                   "from the message: hvdtrain.verify.outcome.REASONS)",
        "layouts": "T2 and P2 at 2 ranks, T2xP2 at 4, fsdp-meta (fsdp, the model built on the meta device) at 2, S2 "
                   "(sequence parallelism, S=2) at 2, T2xS2 (S=2 inside T=2) at 4",
        "run time": f"{run['minutes']:.0f} min on 2 cores shared with other work, one launch per world size",
        **({"re-run since": "; ".join(f"{', '.join(u['families'])} ({', '.join(u.get('layouts', []))}) at `{u['branch']}` {u['commit']} ({u['date']})"
                                      for u in run["updates"])} if run.get("updates") else {}),
        "reproduce": "`python scripts/sweep_hf_layouts.py`; one family: `hvdtrain check-layout gemma2 --tensor_parallel=2`",
    }


def _git(*args: str) -> str:
    result = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
    return result.stdout.strip() or "?"


if __name__ == "__main__":
    sys.exit(main())

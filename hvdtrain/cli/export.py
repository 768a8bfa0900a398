"""The trained model of any checkpoint as files that load without hvdtrain (one process, no MPI):

    hvdtrain export runs/ckpt                          # the newest valid checkpoint in it
    hvdtrain export runs/ckpt/ckpt-000000066.pt        # a full checkpoint
    hvdtrain export runs/ckpt/ckpt-000000066           # a sharded one (consolidated in memory)
    # wrote runs/ckpt/ckpt-000000066-export/model.safetensors and config.yaml

Load it into your own module: ``model.load_state_dict(safetensors.torch.load_file(path))``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, Tuple


HELP = "a checkpoint's model as model.safetensors + config.yaml, loadable without hvdtrain"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", type=Path,
                        help="a full checkpoint (ckpt-NNNNNNNNN.pt), a sharded one (ckpt-NNNNNNNNN/), or a "
                             "checkpoint_dir (its newest valid checkpoint)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the directory to write model.safetensors and config.yaml into "
                             "(default: ckpt-NNNNNNNNN-export beside the checkpoint)")
    parser.add_argument("--force", action="store_true", help="overwrite files already in --out")


def run(args: argparse.Namespace) -> int:
    from hvdtrain.checkpoint import export  # imports torch: only when running
    from hvdtrain.checkpoint import CheckpointError

    try:
        path, state = _read(args.checkpoint)
    except CheckpointError as error:
        print(f"hvdtrain export: {error}", file=sys.stderr)
        return 1
    out = args.out or path.parent / f"{path.name.removesuffix('.pt')}-export"
    existing = [out / name for name in (export.WEIGHTS_FILE, export.CONFIG_FILE) if (out / name).exists()]
    if existing and not args.force:
        print(f"hvdtrain export: {', '.join(map(str, existing))} exists: choose another --out, or --force "
              "to overwrite", file=sys.stderr)
        return 1
    weights = export.export_checkpoint(state, out)
    print(f"wrote {weights} ({len(state['model'])} tensors, step {state['step']}, trained under "
          f"{state.get('strategy', 'ddp')} on {state['world_size']} workers) and {out / export.CONFIG_FILE}")
    return 0


def _read(given: Path) -> Tuple[Path, Dict[str, Any]]:
    """(the checkpoint's path, its full state): a sharded checkpoint is consolidated in memory."""
    from hvdtrain.checkpoint import sharded_format as sharded
    from hvdtrain.checkpoint.consolidate import consolidate
    from hvdtrain.checkpoint.store import CheckpointStore
    from hvdtrain.checkpoint import CheckpointError

    if not given.exists():
        raise CheckpointError(f"{given} does not exist")
    path = given
    if given.is_dir() and not (given / sharded.MANIFEST).exists():  # a checkpoint_dir
        newest = CheckpointStore(given).read_newest_valid()
        if newest is None:
            raise CheckpointError(f"{given} holds no valid checkpoint (ckpt-NNNNNNNNN.pt or ckpt-NNNNNNNNN/)")
        path = newest[0]
    state = consolidate(path) if path.is_dir() else CheckpointStore.read(path)
    return path, state

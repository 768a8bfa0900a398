"""The trained model of any checkpoint as files that load without hvdtrain (one process, no MPI):

    hvdtrain export runs/ckpt                          # the newest valid checkpoint in it
    hvdtrain export runs/ckpt/ckpt-000000066.pt        # a full checkpoint
    hvdtrain export runs/ckpt/ckpt-000000066           # a sharded one (consolidated in memory)
    # wrote runs/ckpt/ckpt-000000066-export/model.safetensors and config.yaml
    hvdtrain export runs/ckpt --format hf --hf-config path/to/config.json   # a Hugging Face model

Load it into your own module: ``model.load_state_dict(safetensors.torch.load_file(path))``; with
``--format hf``, ``AutoModelForCausalLM.from_pretrained(out)`` (or the model's own class).
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
    parser.add_argument("--format", choices=("safetensors", "hf"), default="safetensors",
                        help="safetensors: model.safetensors + config.yaml (default); hf: a directory transformers' "
                             "from_pretrained loads (needs --hf-config)")
    parser.add_argument("--hf-config", type=Path, default=None,
                        help="--format hf: the model's Hugging Face config.json (or a directory holding one: the "
                             "pretrained model's, or a run directory's hf/)")
    parser.add_argument("--max-shard-mb", type=float, default=5000.0,
                        help="--format hf: files of at most this many MB, with an index past one (default 5000)")


def run(args: argparse.Namespace) -> int:
    from hvdtrain.checkpoint import export  # imports torch: only when running
    from hvdtrain.checkpoint import CheckpointError

    try:
        path, state = _read(args.checkpoint)
    except CheckpointError as error:
        print(f"hvdtrain export: {error}", file=sys.stderr)
        return 1
    out = args.out or path.parent / f"{path.name.removesuffix('.pt')}-export"
    if args.format == "hf":
        return _export_hf(args, path, state, out)
    existing = [out / name for name in (export.WEIGHTS_FILE, export.CONFIG_FILE) if (out / name).exists()]
    if existing and not args.force:
        print(f"hvdtrain export: {', '.join(map(str, existing))} exists: choose another --out, or --force "
              "to overwrite", file=sys.stderr)
        return 1
    weights = export.export_checkpoint(state, out)
    print(f"wrote {weights} ({len(state['model'])} tensors, step {state['step']}, trained under "
          f"{state.get('strategy', 'ddp')} on {state['world_size']} workers) and {out / export.CONFIG_FILE}")
    return 0


def _export_hf(args: argparse.Namespace, path: Path, state: Dict[str, Any], out: Path) -> int:
    from hvdtrain.checkpoint import hf_export

    if args.hf_config is None:
        print("hvdtrain export: --format hf needs --hf-config, the model's config.json (a checkpoint holds the "
              "weights, not the Hugging Face config)", file=sys.stderr)
        return 2
    config = args.hf_config / hf_export.CONFIG if args.hf_config.is_dir() else args.hf_config
    if not config.is_file():
        print(f"hvdtrain export: --hf-config {args.hf_config}: no config.json there", file=sys.stderr)
        return 1
    if out.exists() and not args.force:
        print(f"hvdtrain export: {out} exists: choose another --out, or --force to replace it", file=sys.stderr)
        return 1
    failure = hf_export.export_hf(config.read_text(), hf_export.distinct_tensors(state["model"]), out, writes=True,
                                  max_shard_bytes=max(1, int(args.max_shard_mb * 1e6)))
    if failure:
        print(f"hvdtrain export: {failure}", file=sys.stderr)
        return 1
    print(f"wrote {out} (Hugging Face format, {config.name} from {config.parent}; step {state['step']} of {path})")
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

"""The trained model of any checkpoint as files that load without hvdtrain (one process, no MPI):

    hvdtrain export runs/ckpt                          # the newest valid checkpoint in it
    hvdtrain export runs/ckpt/ckpt-000000066.pt        # a full checkpoint
    hvdtrain export runs/ckpt/ckpt-000000066           # a sharded one (of any strategy or mesh)
    # wrote runs/ckpt/ckpt-000000066-export/model.safetensors and config.yaml
    hvdtrain export runs/ckpt --format hf --hf-config path/to/config.json   # a Hugging Face model

Load it into your own module: ``model.load_state_dict(safetensors.torch.load_file(path))``; with
``--format hf``, ``AutoModelForCausalLM.from_pretrained(out)`` (or the model's own class). The
model is read and written one tensor at a time: the export never holds the whole model.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


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
    from hvdtrain.checkpoint import CheckpointError

    try:
        checkpoint = _open(args.checkpoint)
    except CheckpointError as error:
        print(f"hvdtrain export: {error}", file=sys.stderr)
        return 1
    path = checkpoint.path
    out = args.out or path.parent / f"{path.name.removesuffix('.pt')}-export"
    if args.format == "hf":
        return _export_hf(args, checkpoint, out)
    from hvdtrain.weights import export

    existing = [out / name for name in (export.WEIGHTS_FILE, export.CONFIG_FILE) if (out / name).exists()]
    if existing and not args.force:
        print(f"hvdtrain export: {', '.join(map(str, existing))} exists: choose another --out, or --force "
              "to overwrite", file=sys.stderr)
        return 1
    info = checkpoint.info
    try:
        weights = export.export_tensors(checkpoint.tensors(), checkpoint.aliases, out, info.get("config"),
                                        {"step": info["step"], "strategy": info.get("strategy", "ddp"),
                                         "world_size": info["world_size"]})
    except (OSError, ValueError, RuntimeError, CheckpointError) as error:
        print(f"hvdtrain export: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    print(f"wrote {weights} ({checkpoint.count} tensors, step {info['step']}, trained under "
          f"{info.get('strategy', 'ddp')} on {info['world_size']} workers) and {out / export.CONFIG_FILE}")
    return 0


def _export_hf(args: argparse.Namespace, checkpoint: "Checkpoint", out: Path) -> int:
    from hvdtrain.weights import hf_export

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
    failure = hf_export.export_hf(config.read_text(), checkpoint.tensors(), out, writes=True,
                                  max_shard_bytes=max(1, int(args.max_shard_mb * 1e6)))
    if failure:
        print(f"hvdtrain export: {failure}", file=sys.stderr)
        return 1
    print(f"wrote {out} (Hugging Face format, {config.name} from {config.parent}; step {checkpoint.info['step']} "
          f"of {checkpoint.path})")
    return 0


class Checkpoint:
    """A checkpoint's model, read one tensor at a time: a full checkpoint's file is memory-mapped, a
    sharded one's tensors are put together from every rank's file as they are asked for, so the
    export never holds the whole model (``info``: the step, the strategy, the settings)."""

    def __init__(self, path: Path) -> None:
        import torch

        from hvdtrain.checkpoint import CheckpointError
        from hvdtrain.checkpoint.sources import sharded as sources
        from hvdtrain.checkpoint.formats import sharded
        from hvdtrain.weights.hf_export import distinct_tensors, shared_names
        from hvdtrain.checkpoint.formats.full import CheckpointStore

        self.path = path
        if path.is_dir():
            self.info = sharded.read_manifest(path)
            sources.verify(path, self.info, range(self.info["world_size"]))
            source = sources.open_source(path, self.info)
            self.aliases = source.aliases()
            self.tensors = source.model_tensors
            self.count = len(source.model_keys)
        else:
            self.info = CheckpointStore.read(path, mmap=True)
            model = self.info["model"]
            odd = next(((name, value) for name, value in model.items() if not isinstance(value, torch.Tensor)), None)
            if odd:
                raise CheckpointError(f"{path}: model state entry {odd[0]!r} is a {type(odd[1]).__name__}, not a "
                                      "tensor: only tensors can be exported")
            self.aliases = shared_names(model)
            self.tensors = lambda: distinct_tensors(model)
            self.count = len(model)


def _open(given: Path) -> Checkpoint:
    """The checkpoint ``given`` names: a file, a sharded checkpoint's directory, or the newest valid
    checkpoint in a checkpoint_dir."""
    from hvdtrain.checkpoint.formats import sharded
    from hvdtrain.checkpoint.formats.full import CheckpointStore
    from hvdtrain.checkpoint import CheckpointError

    if not given.exists():
        raise CheckpointError(f"{given} does not exist")
    path = given
    if given.is_dir() and not (given / sharded.MANIFEST).exists():  # a checkpoint_dir
        newest = CheckpointStore(given).read_newest_valid()
        if newest is None:
            raise CheckpointError(f"{given} holds no valid checkpoint (ckpt-NNNNNNNNN.pt or ckpt-NNNNNNNNN/)")
        path = newest[0]
    return Checkpoint(path)

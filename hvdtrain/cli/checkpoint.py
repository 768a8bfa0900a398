"""Turn a sharded checkpoint into a full one, in one process (no Horovod, no MPI):

    hvdtrain checkpoint consolidate runs/ckpt/ckpt-000000066
    # wrote runs/ckpt/ckpt-000000066.pt: the run's next start resumes from it, under any strategy
    # and worker count (at the same step, a full checkpoint wins over the directory)

Every rank's file is checked against the manifest (size, sha256) and the slices are put back
together with the layout the shards carry: the model's class is not needed. The result is the
full format, exactly what the strategy's gathered state_dict() would have written. It needs the
memory of the whole model and optimizer state on this machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


HELP = "checkpoints: consolidate a sharded one into a full one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="checkpoint_command", required=True)
    consolidate = commands.add_parser(
        "consolidate", help="a sharded checkpoint as one full file, which any strategy and worker count resumes",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_consolidate_arguments(consolidate)
    consolidate.set_defaults(run=consolidate_checkpoint)


def add_consolidate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", type=Path, help="a sharded checkpoint: a ckpt-NNNNNNNNN directory")
    parser.add_argument("--out", type=Path, default=None,
                        help="the full checkpoint to write (default: ckpt-NNNNNNNNN.pt beside the directory, "
                             "where a resumed run finds it)")
    parser.add_argument("--force", action="store_true", help="overwrite --out if it exists")


def default_output(directory: Path) -> Path:
    return directory.parent / f"{directory.name}.pt"


def consolidate_checkpoint(args: argparse.Namespace) -> int:
    from hvdtrain.checkpoint.formats import sharded  # imports torch: only when running
    from hvdtrain.checkpoint.consolidate import consolidate
    from hvdtrain.checkpoint import CheckpointError
    from hvdtrain.common.atomic import write_atomically

    directory = args.directory
    out = args.out or default_output(directory.resolve())
    problem = _refusal(directory, out, args.force, sharded)
    if problem:
        print(f"hvdtrain checkpoint consolidate: {problem}", file=sys.stderr)
        return 1
    try:
        full = consolidate(directory)
    except CheckpointError as error:
        print(f"hvdtrain checkpoint consolidate: {error}", file=sys.stderr)
        return 1
    import torch

    write_atomically(out, lambda handle: torch.save(full, handle))
    print(f"wrote {out}: the full checkpoint of step {full['step']} ({full['world_size']} shards of "
          f"strategy {full['strategy']}), {out.stat().st_size} bytes; any strategy and worker count resumes it")
    return 0


def _refusal(directory: Path, out: Path, force: bool, sharded) -> str:
    """Why not to start, or ''."""
    if not directory.is_dir():
        return f"{directory} is not a directory: give a sharded checkpoint (ckpt-NNNNNNNNN/)"
    if not (directory / sharded.MANIFEST).exists():
        newest = sharded.newest_in(directory)
        hint = f"; the newest sharded checkpoint in it is {newest}" if newest else ""
        return (f"{directory} has no {sharded.MANIFEST}: not a sharded checkpoint (an interrupted save "
                f"leaves a hidden .ckpt-NNNNNNNNN.tmp directory, which is not one){hint}")
    if out.exists() and not force:
        return f"{out} exists: choose another --out, or --force to overwrite it"
    if not out.parent.is_dir():
        return f"{out.parent} is not a directory"
    return ""

"""Checkpoints, in one process (no Horovod, no MPI): consolidate a sharded one into a full one,
verify one, compare two.

    hvdtrain checkpoint consolidate runs/ckpt/ckpt-000000066
    # wrote runs/ckpt/ckpt-000000066.pt: the run's next start resumes from it, under any strategy
    # and worker count (at the same step, a full checkpoint wins over the directory)

Every rank's file is checked against the manifest (size, checksum) and the slices are put back
together with the layout the shards carry: the model's class is not needed. The result is the
full format (with its checksum file), exactly what the strategy's gathered state_dict() would have
written. It needs the memory of the whole model and optimizer state on this machine.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


VERIFY = """Verify a checkpoint, or compare two of any layouts, in one process (no Horovod, no MPI):

    hvdtrain checkpoint verify runs/ckpt/ckpt-000000066        # every file, checksum and tensor: OK or what is wrong
    hvdtrain checkpoint verify runs/ckpt                       # every checkpoint in a checkpoint_dir
    hvdtrain checkpoint verify runs/a/ckpt-000000066 runs/b/ckpt-000000066.pt   # bitwise, tensor by tensor

A is a full checkpoint (ckpt-NNNNNNNNN.pt), a sharded one (ckpt-NNNNNNNNN/), a checkpoint_dir or a
Hugging Face weights directory. With B, every tensor is put together whole from both (a sharded
checkpoint of 2 ranks against one of 4, of another strategy, a full one, a Hugging Face directory)
and compared bitwise: the model's tensors, and the optimizer's state where both hold it. A
checkpoint_dir stands for its newest valid checkpoint. Exit status 1 when a file is wrong or the
two differ (each difference named: tensor, first differing index, max |A - B|).
"""

HELP = "checkpoints: consolidate a sharded one into a full one, verify one, compare two bitwise"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    commands = parser.add_subparsers(dest="checkpoint_command", required=True)
    consolidate = commands.add_parser(
        "consolidate", help="a sharded checkpoint as one full file, which any strategy and worker count resumes",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_consolidate_arguments(consolidate)
    consolidate.set_defaults(run=consolidate_checkpoint)
    verify = commands.add_parser(
        "verify", help="check every file of a checkpoint (checksums, manifest, tensors), or compare two bitwise",
        description=VERIFY, formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_argument("a", type=Path, metavar="A",
                        help="a checkpoint (ckpt-NNNNNNNNN.pt or ckpt-NNNNNNNNN/), a checkpoint_dir, or a Hugging Face "
                             "weights directory")
    verify.add_argument("b", type=Path, metavar="B", nargs="?", default=None,
                        help="another one, of any layout: every tensor of A and B compared bitwise")
    verify.set_defaults(run=verify_checkpoints)


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
    from hvdtrain.checkpoint.formats.full import write_full

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
    write_full(out, full)  # with its checksum beside it, as a run writes it
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


def verify_checkpoints(args: argparse.Namespace) -> int:
    """``hvdtrain checkpoint verify A [B]``: 0 when A is sound (and equal to B), 1 otherwise."""
    from hvdtrain.checkpoint import CheckpointError

    try:
        if args.b is None:
            return _verify_all(args.a)
        return _compare(args.a, args.b)
    except CheckpointError as error:
        print(f"hvdtrain checkpoint verify: {error}", file=sys.stderr)
        return 1


def _verify_all(given: Path) -> int:
    """Every checkpoint ``given`` names (one, or each of a checkpoint_dir), or a weights directory."""
    from hvdtrain.checkpoint import CheckpointError
    from hvdtrain.checkpoint.formats.full import CheckpointStore
    from hvdtrain.checkpoint.verification import read_everything

    kind = _kind(given)
    if kind == "hf":
        source, _ = _open(given)
        count = read_everything(source)
        print(f"OK {given}: Hugging Face weights, {count} tensors read (such a directory holds no checksums)")
        return 0
    paths = [path for _, path in CheckpointStore(given).steps()] if kind == "checkpoint_dir" else [given]
    if not paths:
        raise CheckpointError(f"{given} holds no checkpoint (ckpt-NNNNNNNNN.pt or ckpt-NNNNNNNNN/)")
    failed = 0
    for path in paths:
        try:
            source, opened = _open(path)
            count = read_everything(source)
        except CheckpointError as error:
            print(f"FAILED {path}: {error}")
            failed += 1
            continue
        files = opened.info["world_size"] if opened.info.get("kind") == "sharded" else 1
        checked = ("no checksum" if opened.notes else "1 file matches its checksum" if files == 1
                   else f"{files} files match their checksums")
        print(f"OK {path}: {opened.description}; {checked}, {count} tensors read")
        for note in opened.notes:
            print(f"  note: {note}")
    if len(paths) > 1:
        print(f"{len(paths) - failed} of {len(paths)} checkpoints OK")
    return 1 if failed else 0


def _compare(a: Path, b: Path) -> int:
    from hvdtrain.checkpoint.comparison import compare, summary

    source_a, opened_a = _open(_newest_if_directory(a))
    source_b, opened_b = _open(_newest_if_directory(b))
    result = compare(source_a, source_b)
    described = [opened.description if opened else "Hugging Face weights" for opened in (opened_a, opened_b)]
    print(f"A: {source_a.where} ({described[0]})\nB: {source_b.where} ({described[1]})")
    for note in (opened_a.notes if opened_a else []) + (opened_b.notes if opened_b else []) + result.notes:
        print(f"note: {note}")
    if result.identical:
        print(f"identical: {result.tensors} tensors compared bitwise")
        return 0
    print(f"{len(result.differences)} difference(s) in {result.tensors} tensors compared:")
    for line in summary(result):
        print(f"  {line}")
    return 1


def _kind(path: Path) -> str:
    """"checkpoint" (a file, or a directory with a manifest), "hf", "checkpoint_dir"; CheckpointError otherwise."""
    from hvdtrain.checkpoint import CheckpointError
    from hvdtrain.checkpoint.formats import sharded

    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.is_file() or (path / sharded.MANIFEST).exists():
        return "checkpoint"
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return "hf"
    return "checkpoint_dir"


def _newest_if_directory(path: Path) -> Path:
    """A checkpoint_dir's newest valid checkpoint (read only: nothing is set aside); others as given."""
    from hvdtrain.checkpoint import CheckpointError
    from hvdtrain.checkpoint.formats.full import CheckpointStore

    if _kind(path) != "checkpoint_dir":
        return path
    newest = CheckpointStore(path).read_newest_valid()
    if newest is None:
        raise CheckpointError(f"{path} holds no valid checkpoint (ckpt-NNNNNNNNN.pt or ckpt-NNNNNNNNN/)")
    return newest[0]


def _open(path: Path):
    """(its tensor source, the checked checkpoint or None for a weights directory)."""
    from hvdtrain.checkpoint.verification import open_checked

    if _kind(path) == "hf":
        from hvdtrain.weights.pretrained import SafetensorsSource

        return SafetensorsSource(path), None
    opened = open_checked(path)
    return opened.source, opened

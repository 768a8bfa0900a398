"""The ``hvdtrain`` command: one module per subcommand, named after it, each with ``HELP``,
``add_arguments(parser)`` and ``run(args) -> int`` (``check-layout``: check_layout.py) (a group of subcommands, such as ``bench``, gives
each of its own parsers its ``run``). Building the parser imports no torch or Horovod
(``--help`` is instant; the tools run on login nodes): a command imports them only when it runs.
May import anything in hvdtrain, the benchmarks included.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

from hvdtrain.common.errors import REFUSED_EXIT_CODE, HvdtrainError, one_line

COMMANDS = ("info", "launch", "doctor", "hosts", "plot", "checkpoint", "export", "plan", "bench", "check-layout", "debug")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hvdtrain", description="Data-parallel PyTorch training on Horovod.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = importlib.import_module(f"hvdtrain.cli.{name.replace('-', '_')}")
        command = commands.add_parser(name, help=module.HELP, description=module.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(command)
        if hasattr(module, "run"):
            command.set_defaults(run=module.run)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command; a refusal (hvdtrain.HvdtrainError) is one line and exit status 2, as a bad option."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except HvdtrainError as refusal:
        print(one_line(refusal), file=sys.stderr)
        return REFUSED_EXIT_CODE

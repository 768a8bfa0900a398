"""``hvdtrain info``: what this install can do: versions, and the back-ends Horovod was built with."""
from __future__ import annotations

import argparse
import platform

HELP = "versions and the back-ends Horovod was built with"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """No options."""


def run(_: argparse.Namespace) -> int:
    import torch
    import horovod
    import horovod.torch as hvd

    import hvdtrain

    rows = [
        ("hvdtrain", hvdtrain.__version__),
        ("python", platform.python_version()),
        ("torch", torch.__version__),
        ("horovod", horovod.__version__),
        ("horovod MPI", "yes" if hvd.mpi_built() else "no"),
        ("horovod Gloo", "yes" if hvd.gloo_built() else "no"),
        ("horovod NCCL", "yes" if hvd.nccl_built() else "no"),
        ("CUDA devices", str(torch.cuda.device_count())),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    return 0

"""train.compile resumes warm on any host: what Inductor compiled, saved beside the checkpoints.

torch keeps what it compiles in a cache directory of the host (/tmp/torchinductor_<user> unless
TORCHINDUCTOR_CACHE_DIR says otherwise): a restart on the same host compiles from it, a restart on
other hosts (a requeued SLURM job, an elastic replacement, a node-local /tmp wiped between jobs)
compiles again from nothing, which takes minutes for a large model. torch.compiler's portable
cache (``save_cache_artifacts``) packs what this process compiled into bytes that
``load_cache_artifacts`` puts into any host's cache. Rank 0 writes them into the checkpoint
directory, atomically, after the first step and at the end of every fit() when they grew; every
rank loads them before its first compile. Artifacts from another CPU or torch version miss and
compile as before (torch's cache key holds both); an unreadable file is named and skipped.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from hvdtrain.common.atomic import write_atomically

CACHE_FILE = "compile-cache.bin"


def artifact_count(info: Any) -> int:
    """How many compiled artifacts torch's CacheInfo lists (its kinds: inductor, aot_autograd, ...)."""
    return sum(len(keys) for keys in getattr(info, "artifacts", {}).values())


class CompileCache:
    """The checkpoint directory's compile cache: loaded by every rank, written by ``is_root``."""

    def __init__(self, directory: Optional[str], is_root: bool, log: logging.Logger) -> None:
        self.path = Path(directory) / CACHE_FILE if directory else None
        self.is_root, self.log = is_root, log
        self.written = 0  # artifacts in the file, as loaded or last written
        self.saved_after_first_step = False

    def load(self) -> int:
        """Every rank, before the first compile: the file's artifacts into this host's cache."""
        if self.path is None or not self.path.is_file():
            return 0
        try:
            info = torch.compiler.load_cache_artifacts(self.path.read_bytes())
        except Exception as error:  # a torn or foreign file: compiling from nothing is always right
            self.log.warning(f"compile cache {self.path} not loaded ({type(error).__name__}: {error}): "
                             "compiling from nothing")
            return 0
        self.written = artifact_count(info)
        self.log.info(f"compile cache: {self.written} compiled artifacts loaded from {self.path}")
        return self.written

    def save(self) -> None:
        """Rank 0: what this process compiled, into the file, when it holds more than the file."""
        if self.path is None or not self.is_root:
            return
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return
        data, info = saved
        count = artifact_count(info)
        if count <= self.written:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(self.path, lambda handle: handle.write(data))
        self.written = count
        self.log.info(f"compile cache: {count} compiled artifacts saved to {self.path} (a restart loads them)")

    def after_first_step(self) -> None:
        if not self.saved_after_first_step:
            self.saved_after_first_step = True
            self.save()

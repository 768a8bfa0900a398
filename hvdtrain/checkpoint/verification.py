"""One checkpoint on disk checked whole, in one process (no Horovod, no MPI): what
``hvdtrain checkpoint verify`` runs.

Every file against its checksum (a full checkpoint's checksum file, a sharded one's manifest), the
manifest's keys and file list, every file loaded (tensors and plain values only), then every model
tensor and every entry of the optimizer's state put together whole, one at a time, through the
checkpoint's tensor source: a checkpoint that passes is one a run can read back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.formats import sharded
from hvdtrain.checkpoint.formats.full import CheckpointStore, checksum_path, verify_full
from hvdtrain.checkpoint.sources import sharded as sources
from hvdtrain.checkpoint.sources.contract import TensorSource
from hvdtrain.checkpoint.sources.full import FullStateSource


@dataclass
class Opened:
    """A checkpoint whose files match their checksums: its tensors, and what it holds besides."""
    source: TensorSource
    info: Dict[str, Any]  # a full checkpoint's whole state, a sharded one's manifest (with "path")
    notes: List[str] = field(default_factory=list)  # what could not be checked, and why

    @property
    def description(self) -> str:
        kind = f"sharded, {self.info['world_size']} files" if sharded.is_sharded(self.info) else "full"
        strategy = self.info.get("strategy")
        return f"step {self.info.get('step')}, {kind}" + (f", strategy {strategy}" if strategy else "")


def open_checked(path: Path) -> Opened:
    """The checkpoint at ``path`` (a ``ckpt-NNNNNNNNN.pt`` file or a ``ckpt-NNNNNNNNN/`` directory),
    every file checked against its checksum and loaded memory-mapped; CheckpointError (a
    CorruptCheckpoint for a file not as written) naming the file and what failed."""
    path = Path(path)
    if path.is_dir():
        manifest = sharded.read_manifest(path)
        sources.verify(path, manifest, range(manifest["world_size"]))
        return Opened(sources.open_source(path, manifest), manifest)
    notes = []
    if checksum_path(path).exists():
        verify_full(path)
    else:
        notes.append(f"{path} has no checksum file ({checksum_path(path).name}): its bytes could not be checked "
                     f"(written before checksums, or by hand)")
    state = CheckpointStore.read(path, mmap=True, verify=False)
    source = FullStateSource(state)
    source.where = str(path)
    return Opened(source, state, notes)


def read_everything(source: TensorSource) -> int:
    """Every model tensor and every optimizer state entry of ``source`` put together whole (its
    files fit together); how many tensors were read. CheckpointError naming what does not fit."""
    count = 0
    try:
        for name in source.model_keys:
            source.full_tensor(name)
            count += 1
        names = source.optimizer_parameter_names()
        for index in range(source.parameter_count() or 0):
            state = source.optimizer_state_of(index, names[index] if names else "") or {}
            count += sum(1 for value in state.values() if hasattr(value, "shape"))
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as error:
        if isinstance(error, CheckpointError):
            raise
        raise CheckpointError(f"{source.where}: its tensors do not fit together: {type(error).__name__}: "
                              f"{error}") from None
    return count

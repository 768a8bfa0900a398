"""A sharded checkpoint resumed at another worker count or under another strategy, without
consolidating it first.

Each rank's file of a flat strategy holds its slice of every flat bucket and the layout (per
bucket: the parameters' names, shapes and offsets), so every element has a global position:
bucket, offset, rank; a mesh's files hold slices and stages (hvdtrain.checkpoint.sources.mesh). A rank
of the new run asks for the elements its own part needs (its slice of each of its buckets, under
its own layout) and reads just those: the files are memory-mapped, so only the pages asked for
are read. A sharded strategy (zero1, zero2, fsdp) receives its part in its own layout and holds
no more than that part and one bucket's slice; a tensor x pipeline mesh takes one whole tensor at
a time and keeps its slices; ddp and ps hold the whole state anyway and receive it whole.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Sequence, Tuple

import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.formats import loading, sharded
from hvdtrain.checkpoint.sources.mesh import MeshSource, is_mesh_part
from hvdtrain.checkpoint.sources.contract import TensorSource
from hvdtrain.common import io_watch
from hvdtrain.strategies.sharding import flat_buckets as fb
from hvdtrain.strategies.sharding.shard_state import assemble_full_state


def files_to_verify(world_size: int, rank: int, files: int) -> List[int]:
    """The files of the checkpoint this rank checks against the manifest (size and checksum): each
    file by exactly one rank, so verifying costs one read of the checkpoint across all ranks."""
    return list(range(rank, files, world_size))


def open_source(path: Path, manifest: Mapping[str, Any]) -> TensorSource:
    """Every rank's file of the sharded checkpoint at ``path``, memory-mapped: a flat strategy's
    (buckets) or a tensor x pipeline mesh's, read through the same questions."""
    files = []
    for entry in manifest["files"]:
        file = Path(path) / entry["name"]
        with io_watch.watching(file, "read"):  # verified against the manifest before it is opened
            state = loading.load(file, verified=True, mmap=True)
        if not isinstance(state, dict) or state.get("rank") != entry["rank"] or "strategy" not in state:
            raise CheckpointError(f"{file} is not rank {entry['rank']}'s shard of an hvdtrain sharded checkpoint")
        files.append(state)
    if is_mesh_part(files[0]["strategy"]):
        return MeshSource(path, files)
    return ShardedSource(path, files)


class ShardedSource(TensorSource):
    """Every rank's part of one sharded checkpoint of flat buckets, memory-mapped, read by parameter
    and element."""

    def __init__(self, path: Path, files: Sequence[Dict[str, Any]]) -> None:
        self.path, self.files = Path(path), list(files)
        self.where = str(self.path)
        self.parts = [file["strategy"] for file in self.files]
        self.world_size = len(self.parts)
        self.layout = self.parts[0]["layout"]
        self.model_keys: List[str] = list(self.layout["model_keys"])
        # name -> (bucket position, bucket index, offset in the bucket, shape)
        self._where: Dict[str, Tuple[int, int, int, Tuple[int, ...]]] = {}
        self._dtypes: Dict[str, torch.dtype] = {}  # a bucket's tensors have its dtype
        for position, entry in enumerate(self.layout["buckets"]):
            for names, shape, offset in zip(entry["names"], entry["shapes"], entry["offsets"]):
                for name in names:
                    self._where[name] = (position, entry["index"], offset, tuple(shape))
                    self._dtypes[name] = getattr(torch, entry["dtype"])
        self._slice = [entry["padded_numel"] // self.world_size for entry in self.layout["buckets"]]

    def holds(self, name: str) -> bool:
        return name in self._where or name in self.unmanaged()

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._where[name][3] if name in self._where else tuple(self.unmanaged()[name].shape)

    def dtype(self, name: str) -> torch.dtype:
        return self._dtypes[name] if name in self._where else self.unmanaged()[name].dtype

    def _read(self, name: str, start: int, stop: int, key: str) -> torch.Tensor:
        """Elements of a parameter flattened, or of its optimizer state, from the ranks' slices that
        hold them (the range is within the parameter: TensorSource.read checked it)."""
        if name not in self._where:
            return super()._read(name, start, stop, key)
        position, index, offset, _ = self._where[name]
        if start == stop:
            return torch.empty(0, dtype=self._dtypes[name])
        low, high, size = offset + start, offset + stop, self._slice[position]
        pieces = []
        for rank in range(low // size, (high - 1) // size + 1):
            part = self.parts[rank]
            flat = part["params"][position] if not key else part["optimizer"]["state"][index][key]
            if flat.numel() != size:
                what = f"the optimizer's {key} of bucket {index}" if key else f"bucket {index}"
                raise CheckpointError(f"{self.where}: rank {rank}'s slice of {what} has {flat.numel()} elements, "
                                      f"the layout says {size}: its files do not fit together")
            pieces.append(flat[max(low, rank * size) - rank * size:min(high, (rank + 1) * size) - rank * size])
        return torch.cat(pieces) if len(pieces) > 1 else pieces[0].clone()

    def optimizer_state(self, name: str) -> Dict[str, Any]:
        """The optimizer's state of the bucket holding ``name`` (rank 0's: the scalars are every rank's)."""
        _, index, _, _ = self._where[name]
        return self.parts[0]["optimizer"]["state"].get(index, {})

    def param_groups(self) -> List[Dict[str, Any]]:
        return self.parts[0]["optimizer"]["param_groups"]

    def unmanaged(self) -> Dict[str, torch.Tensor]:
        return self.parts[0]["unmanaged"]

    def full_state(self) -> Dict[str, Any]:
        """The whole {"model", "optimizer"} state, as consolidation makes it."""
        return assemble_full_state(self.parts)

    def check_flat_layout(self, layout: Mapping[str, Any]) -> None:
        _check_same_model(self.layout, layout)

    # One whole tensor at a time (a tensor x pipeline mesh loading it, an export).

    def full_tensor(self, name: str) -> torch.Tensor:
        if name not in self._where:
            return self.unmanaged()[name]
        shape = self._where[name][3]
        return self.read(name, 0, math.prod(shape)).reshape(shape)

    def optimizer_state_of(self, index: int, name: str) -> Dict[str, Any]:
        """The user's optimizer's state of its parameter ``index`` (named ``name``), whole."""
        if name not in self._where:
            return {}
        shape = self._where[name][3]
        return {key: self.read(name, 0, math.prod(shape), key).reshape(shape) if fb.is_elementwise(value) else value
                for key, value in self.optimizer_state(name).items()}

    def parameter_count(self) -> int:
        return sum(len(indices) for indices in self.layout["group_indices"])

    def optimizer_parameter_names(self) -> List[str]:
        names = {index: aliases[0] for entry in self.layout["buckets"]
                 for aliases, index in zip(entry["names"], entry["param_indices"])}
        return [names.get(index, "") for index in range(self.parameter_count())]

    def aliases(self) -> Dict[str, List[str]]:
        """A tied parameter's first state_dict name -> all its names."""
        return {names[0]: list(names) for entry in self.layout["buckets"] for names in entry["names"] if len(names) > 1}


def _check_same_model(saved: Mapping[str, Any], mine: Mapping[str, Any]) -> None:
    if saved["model_keys"] != mine["model_keys"]:
        extra = sorted(set(saved["model_keys"]) ^ set(mine["model_keys"]))[:5]
        raise CheckpointError(f"it was written for another model: the keys differ ({', '.join(extra) or 'their order'})")
    if saved["group_indices"] != mine["group_indices"]:
        raise CheckpointError(f"it was written for other parameter groups ({saved['group_indices']} saved, "
                              f"{mine['group_indices']} here)")
    trained = {name for entry in saved["buckets"] for names in entry["names"] for name in names}
    missing = [names[0] for entry in mine["buckets"] for names in entry["names"] if names[0] not in trained]
    if missing:
        raise CheckpointError(f"its optimizer did not train {', '.join(missing[:5])}, which this run's does")


def verify(path: Path, manifest: Mapping[str, Any], indices: Sequence[int]) -> None:
    """The files ``indices`` of the checkpoint, checked against the manifest (size and checksum),
    read in blocks: nothing is loaded. CorruptCheckpoint naming the first file that differs."""
    for index in indices:
        with io_watch.watching(Path(path) / manifest["files"][index]["name"], "read"):
            sharded.check_file(Path(path), manifest, index)

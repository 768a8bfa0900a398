"""Pretrained weights from a local Hugging Face model directory (``config.json`` with
``model.safetensors``, or numbered files and ``model.safetensors.index.json``), read as a tensor
source (hvdtrain.checkpoint.sources.contract): each strategy's ``load_from`` reads only what it
keeps, under zero1, zero2 and fsdp its slice of every flat bucket (safetensors reads a tensor's rows
without the rest of the file), under tensor and pipeline parallelism its stage's tensors and of each
split one its slice, under ddp and ps the whole model, which each of their ranks holds anyway. A
tied weight stored once is found under any of its names. The directory holds no optimizer state:
the strategies keep their own.
"""
from __future__ import annotations

import json
import math
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, Tuple

import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.sources.contract import TensorSource
from hvdtrain.common import io_watch
from hvdtrain.weights.hf_export import INDEX, WEIGHTS
from hvdtrain.weights.safetensors_stream import SAFETENSORS_DTYPES

# safetensors' names of the dtypes (its header's "dtype") -> torch's: the writer's table, read backwards.
TORCH_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class SafetensorsSource(TensorSource):
    """The tensors of a Hugging Face weights directory by name, read whole, by a flat range of their
    elements or by a tensor-parallel slice; counts the bytes it hands out (``bytes_read``)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.where = str(self.directory)
        index, single = self.directory / INDEX, self.directory / WEIGHTS
        if index.is_file():
            self.files = {name: self.directory / inside(self.directory, index, file)
                          for name, file in read_weight_map(index).items()}
        elif single.is_file():
            with opened(single) as handle:
                self.files = {name: single for name in handle.keys()}
        else:
            raise CheckpointError(f"{self.directory} holds neither {WEIGHTS} nor {INDEX}: not a Hugging Face "
                                  f"weights directory (save_pretrained writes one)")
        self.model_keys = list(self.files)
        self.bytes_read = 0
        # name -> (shape, safetensors dtype), read from a file's header once for all its tensors: every
        # tensor's shape and dtype are asked before it is read (check_tensor, read's range check).
        self._described: Dict[str, Tuple[Tuple[int, ...], str]] = {}

    def holds(self, name: str) -> bool:
        return name in self.files

    def _description(self, name: str) -> Tuple[Tuple[int, ...], str]:
        """(shape, safetensors dtype) of ``name``, from its file's header."""
        if name not in self._described:
            with opened(self.files[name]) as handle:
                for key in handle.keys():
                    view = handle.get_slice(key)
                    self._described[key] = (tuple(view.get_shape()), view.get_dtype())
            if name not in self._described:
                raise CheckpointError(f"{self.files[name]} holds no tensor {name}, which the index places there")
        return self._described[name]

    def shape(self, name: str) -> Tuple[int, ...]:
        return self._description(name)[0]

    def full_tensor(self, name: str) -> torch.Tensor:
        shape = self.shape(name)
        return self.read(name, 0, math.prod(shape)).reshape(shape)

    def dtype(self, name: str) -> torch.dtype:
        stored = self._description(name)[1]
        if stored not in TORCH_DTYPES:
            raise CheckpointError(f"{name} in {self.directory} is of dtype {stored}, which hvdtrain does not read")
        return TORCH_DTYPES[stored]

    def _read(self, name: str, start: int, stop: int, key: str) -> torch.Tensor:
        """Elements of a tensor flattened (the range within it: TensorSource.read checked it),
        reading only the rows (first-dimension slices) that hold them; ``key`` (an optimizer state
        entry) is refused: the directory holds weights only."""
        if key:
            raise CheckpointError(f"{self.directory} holds weights only: no optimizer state ({key} of {name})")
        with opened(self.files[name]) as handle:
            view = handle.get_slice(name)
            shape = view.get_shape()
            numel = math.prod(shape)
            if not shape or (start == 0 and stop == numel):
                values = handle.get_tensor(name).reshape(-1)
            else:
                row = numel // shape[0]
                first, last = start // row, -(-stop // row)
                values = view[first:last].reshape(-1)[start - first * row:stop - first * row]
        self.bytes_read += values.numel() * values.element_size()
        return values.clone()

    def read_slice(self, name: str, shard: Any) -> torch.Tensor:
        """``shard``'s part of ``name`` (a tensor-parallel TensorShard: its block of dim ``shard.dim``
        in each of its groups), read by safetensors' strided slicing, nothing else of the tensor."""
        with opened(self.files[name]) as handle:
            view = handle.get_slice(name)
            shape = view.get_shape()
            group = shape[shard.dim] // shard.groups
            chunk = group // shard.parts
            lead = (slice(None),) * shard.dim
            parts = [view[lead + (slice(g * group + shard.index * chunk, g * group + (shard.index + 1) * chunk),)]
                     for g in range(shard.groups)]
        values = torch.cat(parts, dim=shard.dim) if len(parts) > 1 else parts[0]
        self.bytes_read += values.numel() * values.element_size()
        return values.clone()


def read_weight_map(index: Path) -> Dict[str, str]:
    """The weight_map of the Hugging Face index ``index`` (tensor name -> file name, as
    save_pretrained writes it); CheckpointError naming the index and what is wrong: unreadable, not
    JSON, not an object, no weight_map, or one that is not an object of names to file names. Whether
    each file name stays inside the directory is ``inside``'s check."""
    remedy = "not the index save_pretrained writes: fix or replace it"
    try:
        with io_watch.watching(index, "read"):
            loaded = json.loads(index.read_text())
    except OSError as error:
        raise CheckpointError(f"{index} cannot be read: {type(error).__name__}: {error}") from None
    except ValueError as error:  # a JSONDecodeError, or bytes that are not UTF-8
        raise CheckpointError(f"{index} is not JSON ({error}): {remedy}") from None
    if not isinstance(loaded, dict):
        raise CheckpointError(f"{index} holds {json_kind(loaded)}, not an object: {remedy}")
    if "weight_map" not in loaded:
        raise CheckpointError(f"{index} has no weight_map: {remedy}")
    weight_map = loaded["weight_map"]
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index}: its weight_map is {json_kind(weight_map)}, not an object of tensor names "
                              f"to file names: {remedy}")
    odd = next((name for name, file in weight_map.items() if not isinstance(file, str)), None)
    if odd is not None:
        raise CheckpointError(f"{index}: weight_map[{odd!r}] is {json_kind(weight_map[odd])}, it must be the name "
                              f"of the file holding it: {remedy}")
    return weight_map


def json_kind(value: Any) -> str:
    """What JSON calls the kind of a parsed value, for a message."""
    return {dict: "an object", list: "a list", str: "a string", bool: "true or false",
            type(None): "null"}.get(type(value), "a number")


def inside(directory: Path, index: Path, file: Any) -> str:
    """``file``, an index's weight_map entry, if it is a plain file name (a file inside the model
    directory); CheckpointError naming the entry otherwise: an index is data, and one naming
    ``../../etc/passwd`` or an absolute path must not make every rank open that."""
    plain = isinstance(file, str) and file not in ("", ".", "..") and os.path.basename(file) == file \
        and "/" not in file and "\\" not in file
    # Lexically inside (not resolved: a Hugging Face cache's files are symlinks into its blobs/).
    if not plain or os.path.dirname(os.path.normpath(directory / file)) != os.path.normpath(directory):
        raise CheckpointError(f"{index}: its weight_map names the file {file!r}, which is not a plain file name in "
                              f"{directory}: an index names the model directory's own files only (as save_pretrained "
                              f"writes it); fix or replace the index")
    return file


@contextmanager
def opened(path: Path) -> Iterator[Any]:
    """safetensors' handle on ``path``, watched while open (hvdtrain.common.io_watch); its errors (a
    corrupt or cut header, a missing file) as CheckpointError naming the file, which load_pretrained
    agrees on across ranks (safetensors' own error is none of the kinds it shares)."""
    from safetensors import SafetensorError, safe_open

    with io_watch.watching(path, "read"):
        try:
            with safe_open(str(path), framework="pt") as handle:
                yield handle
        except SafetensorError as error:
            raise CheckpointError(f"{path} is not a readable safetensors file: {error}") from None

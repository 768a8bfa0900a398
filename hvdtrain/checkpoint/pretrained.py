"""Pretrained weights from a local Hugging Face model directory (``config.json`` with
``model.safetensors``, or numbered files and ``model.safetensors.index.json``), each rank reading
only what it keeps: under zero1, zero2 and fsdp its slice of every flat bucket (safetensors reads a
tensor's rows without the rest of the file), under tensor and pipeline parallelism its stage's
tensors and of each split one its slice, under ddp and ps the whole model, which each of their
ranks holds anyway. A tied weight stored once is found under any of its names.

Reading is local (``own_part``); putting the part in place may be a collective (``apply``), so the
caller agrees on every rank's reading first (Trainer.load_pretrained).
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Dict, Sequence

import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.checkpoint.hf_export import INDEX, WEIGHTS
from hvdtrain.common.capabilities import EVERY_PART, OWN_SHARD
from hvdtrain.strategies.base import Strategy, tensor_names


class SafetensorsReader:
    """The tensors of a Hugging Face weights directory by name, read whole or by a flat range of
    their elements; counts the bytes it hands out."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        index, single = self.directory / INDEX, self.directory / WEIGHTS
        if index.is_file():
            loaded = json.loads(index.read_text())
            weight_map = loaded.get("weight_map") if isinstance(loaded, dict) else None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index} has no weight_map: not the index save_pretrained writes")
            self.files = {name: self.directory / file for name, file in weight_map.items()}
        elif single.is_file():
            from safetensors import safe_open

            with safe_open(str(single), framework="pt") as handle:
                self.files = {name: single for name in handle.keys()}
        else:
            raise CheckpointError(f"{self.directory} holds neither {WEIGHTS} nor {INDEX}: not a Hugging Face "
                                  f"weights directory (save_pretrained writes one)")
        self.bytes_read = 0

    def first_of(self, names: Sequence[str]) -> str:
        """The first of a tensor's names (a tied weight has several) that the directory holds."""
        for name in names:
            if name in self.files:
                return name
        raise CheckpointError(f"{self.directory} has no weights for {' / '.join(names)}: it holds another model")

    def read(self, name: str, shape: Sequence[int], start: int = 0, stop: int = -1) -> torch.Tensor:
        """Elements [start, stop) of ``name`` flattened (stop -1: to the end), reading only the rows
        (first-dimension slices) that hold them; refused unless the stored tensor has ``shape``."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            view = handle.get_slice(name)
            shape, stored = list(shape), view.get_shape()
            if stored != shape:
                raise CheckpointError(f"{name} in {self.directory} has shape {stored}, this model's {shape}: it "
                                      f"holds another model (or another configuration of it)")
            numel = math.prod(shape)
            stop = numel if stop < 0 else stop
            if not shape or (start == 0 and stop == numel):
                values = handle.get_tensor(name).reshape(-1)
            else:
                row = numel // shape[0]
                first, last = start // row, -(-stop // row)
                values = view[first:last].reshape(-1)[start - first * row:stop - first * row]
        self.bytes_read += values.numel() * values.element_size()
        return values.clone()

    def read_slice(self, name: str, shape: Sequence[int], shard: Any) -> torch.Tensor:
        """``shard``'s part of ``name`` (a tensor-parallel TensorShard: its block of dim ``shard.dim``
        in each of its groups), read by safetensors' strided slicing, nothing else of the tensor."""
        from safetensors import safe_open

        with safe_open(str(self.files[name]), framework="pt") as handle:
            view = handle.get_slice(name)
            if view.get_shape() != list(shape):
                raise CheckpointError(f"{name} in {self.directory} has shape {view.get_shape()}, this model's "
                                      f"{list(shape)}: it holds another model (or another configuration of it)")
            group = shape[shard.dim] // shard.groups
            chunk = group // shard.parts
            lead = (slice(None),) * shard.dim
            parts = [view[lead + (slice(g * group + shard.index * chunk, g * group + (shard.index + 1) * chunk),)]
                     for g in range(shard.groups)]
        values = torch.cat(parts, dim=shard.dim) if len(parts) > 1 else parts[0]
        self.bytes_read += values.numel() * values.element_size()
        return values.clone()


def own_part(strategy: Strategy, reader: SafetensorsReader) -> Dict[str, Any]:
    """What this rank keeps of the pretrained weights, in the form ``apply`` puts in place (local)."""
    loads = strategy.capabilities.loads
    if loads == OWN_SHARD:
        return _sharded_part(strategy, reader)
    if loads == EVERY_PART:  # model parallelism: its stage's tensors, its slices of the split ones
        return {"local": _model_parallel_part(strategy, reader)}
    whole = {}
    for names, value in tensor_names(strategy.model):
        tensor = reader.read(reader.first_of(names), value.shape).reshape(value.shape).to(value.dtype)
        whole.update((name, tensor) for name in names)
    return {"model": whole}


def _model_parallel_part(strategy: Strategy, reader: SafetensorsReader) -> Dict[str, torch.Tensor]:
    local = {}
    for names, value in tensor_names(strategy.model):
        if not strategy.holds(value):
            continue
        shape, shard = strategy.full_shapes[names[0]], getattr(value, "tensor_shard", None)
        name = reader.first_of(names)
        tensor = reader.read(name, shape).reshape(shape) if shard is None else reader.read_slice(name, shape, shard)
        local[names[0]] = tensor.to(value.dtype)
    return local


def _sharded_part(strategy: Strategy, reader: SafetensorsReader) -> Dict[str, Any]:
    """This rank's part as its shard_state_dict() holds it (the optimizer's state and groups as they
    are), the pretrained slices and unmanaged tensors in place of its own."""
    part = strategy.shard_state_dict()
    rank, size = part["rank"], part["world_size"]
    params = []
    for entry in part["layout"]["buckets"]:
        slice_size = entry["padded_numel"] // size
        low, high = rank * slice_size, (rank + 1) * slice_size
        flat = torch.zeros(slice_size, dtype=getattr(torch, entry["dtype"]))  # padding stays zero
        for names, shape, offset in zip(entry["names"], entry["shapes"], entry["offsets"]):
            start, stop = max(low, offset), min(high, offset + math.prod(shape))
            if start < stop:
                flat[start - low:stop - low] = reader.read(reader.first_of(names), shape, start - offset, stop - offset)
        params.append(flat)
    unmanaged = {name: reader.read(reader.first_of([name]), value.shape).reshape(value.shape).to(value.dtype)
                 for name, value in part["unmanaged"].items()}
    return {**part, "params": params, "unmanaged": unmanaged}


def apply(strategy: Strategy, part: Dict[str, Any]) -> None:
    """Put a part ``own_part`` read in place (every rank: a ZeRO strategy all-gathers its parameters,
    model parallelism gathers its state)."""
    if strategy.capabilities.loads == OWN_SHARD:
        strategy.load_shard_state_dict(part)
    elif "local" in part:  # each rank's own tensors, read by itself: nothing to send
        with torch.no_grad():
            for names, value in tensor_names(strategy.model):
                if names[0] in part["local"]:
                    value.copy_(part["local"][names[0]])
    else:
        strategy.load_state_dict({"model": part["model"], "optimizer": strategy.state_dict()["optimizer"]})

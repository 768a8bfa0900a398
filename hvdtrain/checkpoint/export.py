"""The trained model as files any program can load without hvdtrain: ``model.safetensors`` and the
resolved settings beside it.

safetensors holds named tensors and a string table, nothing executable, and loads with
``safetensors.torch.load_file`` (or in numpy, JAX, Rust...). The weights are the unwrapped model's
``state_dict()``: the same names as the user's own ``nn.Module``, so
``model.load_state_dict(load_file("model.safetensors"))`` restores it. Tensors that share memory
(tied embeddings, views of ZeRO's flat buffers) are written as separate copies, as safetensors asks.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
import yaml

from hvdtrain.common.atomic import atomic_path, write_atomically, write_text_atomically

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"
# safetensors' names of torch's dtypes (its format's specification).
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}


def _plain_tensors(state: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """Contiguous CPU copies that own their memory; anything that is not a tensor is refused."""
    tensors = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model state entry {name!r} is a {type(value).__name__}, not a tensor: "
                            "only tensors can be exported")
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
    return tensors


def export_model(model_state: Mapping[str, Any], directory: os.PathLike, config: Optional[Mapping[str, Any]] = None,
                 metadata: Optional[Mapping[str, Any]] = None) -> Path:
    """Write ``directory/model.safetensors`` (and ``config.yaml`` when ``config`` is given); each
    file appears whole or not at all. ``metadata`` (step, strategy...) goes into the file's string
    table. Returns the weights' path."""
    from safetensors.torch import save_file  # only an export pays for the import

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / WEIGHTS_FILE
    strings = {"format": "pt", **{key: json.dumps(value) for key, value in (metadata or {}).items()}}
    tensors = _plain_tensors(model_state)
    with atomic_path(weights) as temporary:
        save_file(tensors, str(temporary), metadata=strings)
    if config is not None:
        write_text_atomically(directory / CONFIG_FILE, yaml.safe_dump(dict(config), sort_keys=False))
    return weights


def export_model_streamed(tensors: Iterable[Tuple[str, torch.Tensor]], aliases: Mapping[str, List[str]],
                          directory: os.PathLike, writes: bool, metadata: Optional[Mapping[str, Any]] = None,
                          ) -> Optional[str]:
    """``directory/model.safetensors`` as ``export_model`` writes it, from tensors handed one at a
    time (``Strategy.full_tensors()``: under fsdp one unit gathered at a time), each under every
    name in ``aliases`` (a tied weight under each of its names). Only where ``writes`` (rank 0) is
    anything copied: one tensor at a time into a data file beside the result; once every name, dtype
    and shape is known, safetensors' header and then the data form the file, which appears whole or
    not at all. Every rank iterates to the end, also after a failed write (they may be
    collectives). Returns what went wrong on the writer (share it with the other ranks), or None."""
    tensors = iter(tensors)
    failure = None
    if writes:
        try:
            _write_streamed(tensors, aliases, Path(directory), metadata or {})
        except (OSError, ValueError, RuntimeError, KeyError) as error:
            failure = f"writing {Path(directory) / WEIGHTS_FILE} failed: {type(error).__name__}: {error}"
    for _ in tensors:
        pass
    return failure


def _write_streamed(tensors: Iterator[Tuple[str, torch.Tensor]], aliases: Mapping[str, List[str]], directory: Path,
                    metadata: Mapping[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    weights = directory / WEIGHTS_FILE
    header: Dict[str, Any] = {"__metadata__": {"format": "pt", **{k: json.dumps(v) for k, v in metadata.items()}}}
    data_path = weights.with_name(f".{WEIGHTS_FILE}.data")
    offset = 0
    try:
        with open(data_path, "wb") as data:
            for name, tensor in tensors:
                # A copy: numpy's view of a tensor makes its storage unresizable, and fsdp frees the
                # gathered unit (resizes its storage to 0) once the next tensor is asked for.
                copy = tensor.detach().to("cpu", copy=True).contiguous()
                raw = copy.reshape(-1).view(torch.uint8).numpy().tobytes()
                for alias in aliases.get(name, [name]):
                    if alias in header:
                        continue
                    if tensor.dtype not in SAFETENSORS_DTYPES:
                        raise ValueError(f"{alias}: safetensors has no dtype {tensor.dtype}")
                    data.write(raw)
                    header[alias] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                                     "data_offsets": [offset, offset + len(raw)]}
                    offset += len(raw)
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data start 8-byte aligned, as safetensors writes them

        def write(out: BinaryIO) -> None:
            out.write(len(encoded).to_bytes(8, "little"))
            out.write(encoded)
            with open(data_path, "rb") as data:
                shutil.copyfileobj(data, out, 16 * 2**20)

        write_atomically(weights, write)
    finally:
        data_path.unlink(missing_ok=True)


def export_checkpoint(checkpoint: Mapping[str, Any], directory: os.PathLike) -> Path:
    """A full checkpoint's model and settings as ``model.safetensors`` + ``config.yaml``."""
    metadata = {"step": checkpoint.get("step"), "strategy": checkpoint.get("strategy", "ddp"),
                "world_size": checkpoint.get("world_size")}
    return export_model(checkpoint["model"], directory, checkpoint.get("config"), metadata)


def read_metadata(path: os.PathLike) -> Dict[str, Any]:
    """The string table of an exported file, decoded (``format`` stays a string)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        table = handle.metadata() or {}
    return {key: value if key == "format" else json.loads(value) for key, value in table.items()}

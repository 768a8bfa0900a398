"""A Hugging Face model as a directory ``transformers``' ``from_pretrained`` loads: ``config.json``
and ``model.safetensors``, or past ``max_shard_bytes`` ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json`` (Hugging Face's own layout), the tensors under the model's own
state_dict names, a tied weight once (as ``save_pretrained`` writes it; loading ties it again).

The tensors come from ``Strategy.full_tensors()``, one at a time: under fsdp one unit is gathered
at a time, and rank 0 holds at most one file's worth before writing it, so no rank holds the whole
model. The directory is written beside its place and moved there whole once complete (an existing
one is replaced only then): a run killed mid-export leaves the previous export, or none.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from hvdtrain.common.atomic import fsync_directory, fsync_path, write_text_atomically

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default, "5GB"


def is_hf_model(model: torch.nn.Module) -> bool:
    """A transformers PreTrainedModel, by what the export needs of one (no transformers import)."""
    config = getattr(model, "config", None)
    return hasattr(model, "save_pretrained") and hasattr(config, "to_json_string")


def hf_config_text(model: torch.nn.Module) -> str:
    """The model's config.json as save_pretrained writes it: its class as the architecture."""
    config = model.config
    config.architectures = [type(model).__name__]
    return config.to_json_string(use_diff=True)


def distinct_tensors(state: Mapping[str, torch.Tensor]) -> Iterator[Tuple[str, torch.Tensor]]:
    """A loaded state_dict's entries, a tensor that another name shares (a tied weight) once."""
    seen = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if key not in seen:
            seen.add(key)
            yield name, tensor


def export_hf(config_json: str, tensors: Iterable[Tuple[str, torch.Tensor]], directory: os.PathLike,
              writes: bool, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Optional[str]:
    """Write ``directory`` from ``tensors``; only where ``writes`` (rank 0) are they copied and
    written. Every rank iterates them to the end, also after a failed write: they may be collectives.
    Returns what went wrong on the writer (share it with the other ranks), or None."""
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    tensors = iter(tensors)
    failure = None
    if writes:
        try:
            _write_directory(config_json, tensors, Path(directory), max_shard_bytes)
        except (OSError, ValueError, RuntimeError) as error:
            failure = f"the Hugging Face export to {directory} failed: {type(error).__name__}: {error}"
    for _ in tensors:  # the rest, on a rank that does not write or whose write failed
        pass
    return failure


def _write_directory(config_json: str, tensors: Iterator[Tuple[str, torch.Tensor]], final: Path,
                     max_shard_bytes: int) -> None:
    staging = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    files: List[Dict[str, Any]] = []
    pending: Dict[str, torch.Tensor] = {}
    pending_bytes = total = 0
    for name, tensor in tensors:
        copy = tensor.detach().to("cpu", copy=True).contiguous()
        size = copy.numel() * copy.element_size()
        if pending and pending_bytes + size > max_shard_bytes:
            files.append(_write_part(staging, len(files), pending))
            pending, pending_bytes = {}, 0
        pending[name] = copy
        pending_bytes += size
        total += size
    files.append(_write_part(staging, len(files), pending))
    _name_parts(staging, files, total)
    write_text_atomically(staging / CONFIG, config_json)
    fsync_directory(staging)
    _replace_directory(staging, final)


def _write_part(directory: Path, index: int, tensors: Dict[str, torch.Tensor]) -> Dict[str, Any]:
    """One file of the export, under a provisional name (the count of files is known at the end)."""
    from safetensors.torch import save_file  # only an export pays for the import

    path = directory / f"part-{index:05d}.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})  # transformers checks format == "pt"
    fsync_path(path)
    return {"path": path, "names": list(tensors)}


def _name_parts(directory: Path, parts: List[Dict[str, Any]], total: int) -> None:
    """One file: model.safetensors. More: Hugging Face's numbered names and the index of names."""
    if len(parts) == 1:
        parts[0]["path"].rename(directory / WEIGHTS)
        return
    weight_map = {}
    for number, part in enumerate(parts, start=1):
        name = f"model-{number:05d}-of-{len(parts):05d}.safetensors"
        part["path"].rename(directory / name)
        weight_map.update((tensor, name) for tensor in part["names"])
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    write_text_atomically(directory / INDEX, json.dumps(index, indent=2) + "\n")


def _replace_directory(staging: Path, final: Path) -> None:
    """``staging`` becomes ``final``; a previous ``final`` is moved aside first, removed after."""
    previous = final.with_name(f".{final.name}.old")
    shutil.rmtree(previous, ignore_errors=True)
    if final.exists():
        final.rename(previous)
    staging.rename(final)
    fsync_directory(final.parent)
    shutil.rmtree(previous, ignore_errors=True)

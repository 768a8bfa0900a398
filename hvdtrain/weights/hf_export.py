"""A Hugging Face model as a directory ``transformers``' ``from_pretrained`` loads: ``config.json``
and ``model.safetensors``, or past ``max_shard_bytes`` ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json`` (Hugging Face's own layout), the tensors under the model's own
state_dict names, a tied weight once (as ``save_pretrained`` writes it; loading ties it again).

The tensors come from ``Strategy.full_tensors()``, one at a time: under fsdp one unit is gathered
at a time, under a tensor/pipeline mesh one tensor, and rank 0 writes each before the next comes
(hvdtrain.weights.safetensors_stream), so no rank holds the whole model. The directory is written beside its place and moved there whole once complete (an existing
one is replaced only then): a run killed mid-export leaves the previous export, or none.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch

from hvdtrain.weights.safetensors_stream import StreamedSafetensors
from hvdtrain.common.atomic import fsync_directory, write_text_atomically

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


def _storage_key(tensor: torch.Tensor) -> Tuple[Any, ...]:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())


def distinct_tensors(state: Mapping[str, torch.Tensor]) -> Iterator[Tuple[str, torch.Tensor]]:
    """A loaded state_dict's entries, a tensor that another name shares (a tied weight) once."""
    seen = set()
    for name, tensor in state.items():
        key = _storage_key(tensor)
        if key not in seen:
            seen.add(key)
            yield name, tensor


def shared_names(state: Mapping[str, torch.Tensor]) -> Dict[str, List[str]]:
    """The first name of each tensor that several names share -> all its names (a tied weight)."""
    names: Dict[Tuple[Any, ...], List[str]] = {}
    for name, tensor in state.items():
        names.setdefault(_storage_key(tensor), []).append(name)
    return {group[0]: group for group in names.values() if len(group) > 1}


def export_hf(config_json: str, tensors: Iterable[Tuple[str, torch.Tensor]], directory: os.PathLike,
              writes: bool, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Optional[str]:
    """Write the Hugging Face directory; only the writer copies and writes the tensors. Every rank
    iterates them to the end, also after a failed write: they may be collectives. Returns what went
    wrong on the writer (share it with the other ranks), or None.

    Args:
        config_json: the text of config.json (hf_config_text).
        tensors: (state_dict name, tensor) one at a time (``Strategy.full_tensors()``), a tied weight once.
        directory: the directory written, replaced whole once complete.
        writes: whether this rank writes (rank 0).
        max_shard_bytes: bytes per safetensors file at most before the next one starts (a larger tensor
            alone in its file); past one file, Hugging Face's numbered files and index.
    """
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
    parts: List[StreamedSafetensors] = []
    total = 0
    try:
        for name, tensor in tensors:
            size = tensor.numel() * tensor.element_size()
            if not parts or (parts[-1].bytes and parts[-1].bytes + size > max_shard_bytes):
                if parts:
                    parts[-1].close()
                # A provisional name: the count of files is known at the end.
                parts.append(StreamedSafetensors(staging / f"part-{len(parts):05d}.safetensors"))
            total += parts[-1].add(tensor, [name])
        if not parts:
            raise ValueError("the model has no tensors to export")
        parts[-1].close()
        _name_parts(staging, [{"path": part.path, "names": part.names} for part in parts], total)
        write_text_atomically(staging / CONFIG, config_json)
        fsync_directory(staging)
        _replace_directory(staging, final)
    except BaseException:  # Ctrl-C too: the staging directory is no export
        shutil.rmtree(staging, ignore_errors=True)
        raise


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
    try:
        staging.rename(final)
    except BaseException:
        if previous.exists():
            previous.rename(final)  # the previous export stays where it was
        raise
    fsync_directory(final.parent)
    shutil.rmtree(previous, ignore_errors=True)

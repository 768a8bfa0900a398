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
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import torch
import yaml

from hvdtrain.weights.safetensors_stream import StreamedSafetensors
from hvdtrain.common.atomic import write_text_atomically

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"


def export_model_streamed(tensors: Iterable[Tuple[str, torch.Tensor]], aliases: Mapping[str, List[str]],
                          directory: os.PathLike, writes: bool, metadata: Optional[Mapping[str, Any]] = None,
                          ) -> Optional[str]:
    """``directory/model.safetensors`` as ``export_tensors`` writes it, from tensors handed one at a
    time. Only the writer copies anything: one tensor at a time into a data file beside the result;
    once every name, dtype and shape is known, safetensors' header and then the data form the file,
    which appears whole or not at all. Every rank iterates to the end, also after a failed write (they
    may be collectives). Returns what went wrong on the writer (share it with the other ranks), or None.

    Args:
        tensors: (name, tensor) one at a time (``Strategy.full_tensors()``: under fsdp one unit gathered
            at a time).
        aliases: a tensor's name -> every name it is written under (a tied weight's); absent: its own.
        directory: where model.safetensors goes.
        writes: whether this rank writes (rank 0).
        metadata: the file's string table, each value as JSON (the step, the strategy).
    """
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
    writer = StreamedSafetensors(directory / WEIGHTS_FILE, {k: json.dumps(v) for k, v in metadata.items()})
    try:
        for name, tensor in tensors:
            writer.add(tensor, aliases.get(name, [name]))
    except BaseException:
        writer.discard()
        raise
    writer.close()


def export_tensors(tensors: Iterable[Tuple[str, torch.Tensor]], aliases: Mapping[str, List[str]],
                   directory: os.PathLike, config: Optional[Mapping[str, Any]] = None,
                   metadata: Optional[Mapping[str, Any]] = None) -> Path:
    """``model.safetensors`` (and ``config.yaml``) from tensors read one at a time; raises what went
    wrong (a failed or interrupted export leaves no file of its own, nor the directory if it made
    it). Returns the weights file's path.

    Args:
        tensors: (name, tensor) one at a time (a checkpoint read by slice: ``hvdtrain export``).
        aliases: a tensor's name -> every name it is written under (a tied weight's); absent: its own.
        directory: where the files go.
        config: the run's resolved settings, written as config.yaml (None: no config.yaml).
        metadata: the file's string table, each value as JSON (the step, the strategy, the worker count).
    """
    directory = Path(directory)
    made = not directory.exists()
    written: List[Path] = []
    try:
        _write_streamed(iter(tensors), aliases, directory, metadata or {})
        written.append(directory / WEIGHTS_FILE)
        if config is not None:
            write_text_atomically(directory / CONFIG_FILE, yaml.safe_dump(dict(config), sort_keys=False))
    except BaseException:  # Ctrl-C too: weights without their settings are no export
        for path in written:
            path.unlink(missing_ok=True)
        if made:
            shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory / WEIGHTS_FILE


def read_metadata(path: os.PathLike) -> Dict[str, Any]:
    """The string table of an exported file, decoded (``format`` stays a string)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        table = handle.metadata() or {}
    return {key: value if key == "format" else json.loads(value) for key, value in table.items()}

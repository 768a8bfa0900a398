"""A sharded checkpoint written over a tensor x pipeline mesh, read back a tensor at a time.

Each rank's file holds what that rank writes of the state (every element is written by exactly
one rank: the first data replica's, the first stage holding it, each tensor rank's slice of a split
tensor and tensor rank 0's copy of a replicated one; zero1's optimizer state by its owner; under
expert parallelism each expert by the first expert group, and under fsdp x experts each rank's
range of every parameter its slices of the flat buckets cut):

  layout     {"kind": "mesh", "mesh": [data, pipeline, tensor], "model_keys": the full model's state_dict
             names in order, "tied": the names of each tensor that has several, "optimizer_names": per
             parameter group, the full optimizer's parameters by name}
  model      {name: this rank's piece or copy}          model_shards     {name: the piece's spec}
  optimizer  {"state": {index: {key: piece or value}}, "shards": {index: {key: spec}}, "param_groups": [...]}

A piece's spec is a TensorShard's (a slice along a dim) or a FlatRange's (elements [start, stop) of
the tensor flattened); hvdtrain.parallel.tensor.shard.piece_from_spec tells them apart.

A reader asks for one whole tensor at a time: its pieces come from the files that hold them (the
files are memory-mapped: only the pages asked for are read) and are put together, so no reader
holds more than the tensor asked for and its own part; of a tensor written in flat ranges, an
element range is read from the pieces that hold it alone. The same source serves a mesh of any other
shape, the flat strategies (zero1/zero2/fsdp read element ranges through ``read``; ddp and ps
``full_state()``), consolidation and export.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.common import io_watch
from hvdtrain.checkpoint.sources.contract import TensorSource
from hvdtrain.parallel.tensor.shard import FlatRange, TensorShard, piece_from_spec

KIND = "mesh"
Piece = Tuple[Any, torch.Tensor]  # (the piece's spec, or None for the whole tensor; its values)


def is_mesh_part(part: Mapping[str, Any]) -> bool:
    """Whether a rank's strategy part was written over a mesh (rather than in flat buckets)."""
    return isinstance(part.get("layout"), dict) and part["layout"].get("kind") == KIND


def assemble(pieces: Sequence[Piece], what: str) -> torch.Tensor:
    """The whole tensor from the pieces the ranks wrote: one whole copy, or slices that tile it."""
    whole = [tensor for spec, tensor in pieces if spec is None]
    if whole:
        return whole[0]
    if not pieces:
        raise CheckpointError(f"no rank wrote {what}")
    if any(isinstance(spec, dict) for spec, _ in pieces):
        return _assemble_ranges(pieces, what)
    first = TensorShard.from_spec(pieces[0][0])
    shape = list(pieces[0][1].shape)
    shape[first.dim] *= first.parts
    full = torch.empty(shape, dtype=pieces[0][1].dtype)
    indices = sorted(TensorShard.from_spec(spec).index for spec, _ in pieces)
    if indices != list(range(first.parts)):
        raise CheckpointError(f"{what}: the files hold slices {indices} of {first.parts}: a file is missing or "
                              f"from another checkpoint")
    for spec, tensor in pieces:
        TensorShard.from_spec(spec).place(full, tensor)
    return full


def _ranges(pieces: Sequence[Piece], what: str) -> List[Tuple[FlatRange, torch.Tensor]]:
    """The pieces of a tensor written in flat ranges, by start; CheckpointError unless every one is a
    range of the same shape."""
    if not all(isinstance(spec, dict) for spec, _ in pieces):
        raise CheckpointError(f"{what}: the files hold it both in flat ranges and otherwise: they come from "
                              f"different checkpoints")
    ranges = sorted(((FlatRange.from_spec(spec), tensor) for spec, tensor in pieces), key=lambda p: p[0].start)
    if len({r.shape for r, _ in ranges}) != 1:
        raise CheckpointError(f"{what}: the files hold ranges of shapes {sorted({r.shape for r, _ in ranges})}")
    return ranges


def _assemble_ranges(pieces: Sequence[Piece], what: str) -> torch.Tensor:
    """The whole tensor from ranges that tile its elements, each once."""
    ranges = _ranges(pieces, what)
    shape = ranges[0][0].shape
    bounds = [(r.start, r.stop) for r, _ in ranges]
    if bounds[0][0] != 0 or bounds[-1][1] != math.prod(shape) or any(
            stop != start for (_, stop), (start, _) in zip(bounds, bounds[1:])):
        raise CheckpointError(f"{what}: the files hold elements {bounds} of {math.prod(shape)}: a file is missing "
                              f"or from another checkpoint")
    return torch.cat([tensor.reshape(-1) for _, tensor in ranges]).reshape(shape)


def _read_ranges(pieces: Sequence[Piece], start: int, stop: int, what: str) -> torch.Tensor:
    """Elements [start, stop) of a tensor written in flat ranges, from the pieces that hold them."""
    taken = []
    for piece, tensor in _ranges(pieces, what):
        low, high = max(start, piece.start), min(stop, piece.stop)
        if low < high:
            taken.append(tensor.reshape(-1)[low - piece.start:high - piece.start])
    return torch.cat(taken) if taken else torch.empty(0, dtype=pieces[0][1].dtype)


class MeshSource(TensorSource):
    """Every rank's file of one mesh checkpoint, memory-mapped, read one whole tensor at a time."""

    def __init__(self, path: Path, files: Sequence[Dict[str, Any]]) -> None:
        self.path, self.files = Path(path), list(files)
        self.where = str(self.path)
        parts = [file["strategy"] for file in self.files]
        self.layout = parts[0]["layout"]
        for rank, part in enumerate(parts):
            if part.get("layout") != self.layout:
                raise CheckpointError(f"{self.path}: rank {rank}'s layout differs from rank 0's: the files come from "
                                      f"different runs")
        self.model_keys: List[str] = list(self.layout["model_keys"])
        self.optimizer_names: List[List[str]] = [list(names) for names in self.layout["optimizer_names"]]
        self.index_of = {name: i for i, name in enumerate(n for names in self.optimizer_names for n in names)}
        self._model: Dict[str, List[Piece]] = {}
        self._state: Dict[int, Dict[str, List[Piece]]] = {}
        self._values: Dict[int, Dict[str, Any]] = {}
        for part in parts:
            for name, tensor in part["model"].items():
                self._model.setdefault(name, []).append((part["model_shards"].get(name), tensor))
            shards = part["optimizer"]["shards"]
            for index, entries in part["optimizer"]["state"].items():
                for key, value in entries.items():
                    if isinstance(value, torch.Tensor):
                        spec = shards.get(index, {}).get(key)
                        self._state.setdefault(index, {}).setdefault(key, []).append((spec, value))
                    else:
                        self._values.setdefault(index, {})[key] = value
        missing = [name for name in self.model_keys if name not in self._model]
        if missing:
            raise CheckpointError(f"{self.path}: no file holds {', '.join(missing[:5])}")
        self._cached: Tuple[Any, Optional[torch.Tensor]] = (None, None)
        # A tied tensor's names, all trained or none: the optimizer knows it by its first name.
        self._tied_trained = {name for names in self.layout.get("tied", []) if names[0] in self.index_of
                              for name in names}

    # --- one whole tensor at a time -----------------------------------------------------------

    def full_tensor(self, name: str) -> torch.Tensor:
        """The model's tensor ``name``, whole."""
        return assemble(self._model[name], name)

    def optimizer_state_of(self, index: int, name: str = "") -> Dict[str, Any]:
        """The full optimizer's state of its parameter ``index``: per-element entries whole, scalars."""
        state = {key: assemble(pieces, f"the optimizer's {key} of {name or index}")
                 for key, pieces in self._state.get(index, {}).items()}
        state.update(self._values.get(index, {}))
        return state

    def param_groups(self) -> List[Dict[str, Any]]:
        """The parameter groups' hyperparameters (rank 0's: every rank steps with the same)."""
        return [dict(group) for group in self.files[0]["strategy"]["optimizer"]["param_groups"]]

    def parameter_count(self) -> int:
        return len(self.index_of)

    def optimizer_parameter_names(self) -> List[str]:
        return [name for names in self.optimizer_names for name in names]

    def aliases(self) -> Dict[str, List[str]]:
        """A tied tensor's first state_dict name -> all its names (a tied embedding and head)."""
        return {names[0]: list(names) for names in self.layout.get("tied", [])}

    def full_state(self) -> Dict[str, Any]:
        """The whole {"model", "optimizer"} state, as a gathered checkpoint holds it (it needs the
        memory of all of it: consolidation, and the strategies that hold everything anyway)."""
        state = {index: entry for index in range(self.parameter_count())
                 if (entry := self.optimizer_state_of(index))}
        groups, start = [], 0
        for group, names in zip(self.param_groups(), self.optimizer_names):
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(start, start + len(names)))})
            start += len(names)
        return {"model": {name: self.full_tensor(name).clone() for name in self.model_keys},
                "optimizer": {"state": state, "param_groups": groups}}

    # --- element ranges, for a flat sharded strategy (Strategy.load_from) ---

    def holds(self, name: str) -> bool:
        return name in self._model

    def shape(self, name: str) -> Tuple[int, ...]:
        spec, tensor = self._model[name][0]
        piece = piece_from_spec(spec) if spec is not None else None
        if isinstance(piece, FlatRange):
            return piece.shape
        shape = list(tensor.shape)
        if piece is not None:
            shape[piece.dim] *= piece.parts
        return tuple(shape)

    def _trained(self, name: str) -> bool:
        """Whether the optimizer trains ``name``'s tensor (under this name or a tied one's)."""
        return name in self.index_of or name in self._tied_trained

    def dtype(self, name: str) -> torch.dtype:
        return self._model[name][0][1].dtype

    def _read(self, name: str, start: int, stop: int, key: str) -> torch.Tensor:
        """Elements of a parameter flattened, or of its optimizer state (the range is within the
        parameter: TensorSource.read checked it). The whole tensor is kept until another is asked
        for: a bucket reads a tensor's elements in one or two calls. A tensor written in flat ranges
        is read from the pieces holding the range alone."""
        pieces = self._model[name] if not key else self._state.get(self.index_of[name], {}).get(key)
        if pieces and isinstance(pieces[0][0], dict):
            return _read_ranges(pieces, start, stop, f"the optimizer's {key} of {name}" if key else name).clone()
        if self._cached[0] != (name, key):
            whole = self.full_tensor(name) if not key else self.optimizer_state_of(self.index_of[name], name)[key]
            if whole.numel() != self.numel(name):
                raise CheckpointError(f"the optimizer's {key} of {name} in {self.where} has {whole.numel()} elements, "
                                      f"the tensor {self.numel(name)}: its files do not fit together")
            self._cached = ((name, key), whole.reshape(-1))
        return self._cached[1][start:stop].clone()

    def optimizer_state(self, name: str) -> Dict[str, Any]:
        """The optimizer's state of ``name``: scalars, per-element entries whole, but an entry written in
        flat ranges as one of its pieces (its elements are asked by ``read``: a flat strategy's rank
        reads only its own ranges of it)."""
        index = self.index_of[name]
        state: Dict[str, Any] = {}
        for key, pieces in self._state.get(index, {}).items():
            ranged = isinstance(pieces[0][0], dict)
            state[key] = pieces[0][1] if ranged else assemble(pieces, f"the optimizer's {key} of {name}")
        state.update(self._values.get(index, {}))
        return state

    def read_slice(self, name: str, shard: Any) -> torch.Tensor:
        """A rank's slice of tensor ``name``: a file's piece when one holds exactly that slice (the same
        layout), else cut from the whole tensor."""
        for spec, tensor in self._model[name]:
            if isinstance(spec, list) and TensorShard.from_spec(spec) == shard:
                values = tensor.clone()
                io_watch.progress(values.numel() * values.element_size())  # its memory-mapped pages came in
                return values
        return super().read_slice(name, shard)

    def unmanaged(self) -> Dict[str, torch.Tensor]:
        """Buffers and the parameters the optimizer does not train, whole."""
        return {name: self.full_tensor(name) for name in self.model_keys if not self._trained(name)}

    def check_flat_layout(self, layout: Mapping[str, Any]) -> None:
        """CheckpointError unless a flat strategy's ``layout`` is of the model and optimizer written here."""
        if list(layout["model_keys"]) != self.model_keys:
            extra = sorted(set(layout["model_keys"]) ^ set(self.model_keys))[:5]
            raise CheckpointError(f"it was written for another model: the keys differ ({', '.join(extra) or 'their order'})")
        if [len(g) for g in layout["group_indices"]] != [len(names) for names in self.optimizer_names]:
            raise CheckpointError(f"it was written for other parameter groups ({[len(n) for n in self.optimizer_names]} "
                                  f"parameters per group saved, {[len(g) for g in layout['group_indices']]} here)")
        missing = [names[0] for entry in layout["buckets"] for names in entry["names"] if names[0] not in self.index_of]
        if missing:
            raise CheckpointError(f"its optimizer did not train {', '.join(missing[:5])}, which this run's does")

"""What every source of a model's tensors answers, with the same names: a full checkpoint in memory
(hvdtrain.checkpoint.sources.full), a sharded checkpoint of flat buckets (sources.sharded) or of a
tensor x pipeline mesh (sources.mesh), and a Hugging Face weights directory
(hvdtrain.weights.pretrained). A strategy's ``load_from(source)`` reads what it keeps through these
questions alone, so it loads from any of them.

A source that cannot answer a question says so: a weights directory holds no optimizer state, so
its ``param_groups()`` and ``optimizer_state()`` are None and ``read(..., key)`` raises.

A reader checks a tensor's shape and dtype against its model's (``check_tensor``) before it reads
any of it, and ``read`` refuses a range outside the stored tensor (checked here, for every source,
before the source's own ``_read``): a checkpoint of another model is refused by name, never read
past one tensor into the next. A resumed checkpoint has this model's dtypes exactly; pretrained
weights (no optimizer state) may be of another floating-point dtype, converted as they are read
(``check_tensor(..., cast=True)``: bf16 weights into an fp32 model).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

import torch

from hvdtrain.checkpoint import CheckpointError
from hvdtrain.common import io_watch

FIX = ("it belongs to another model or another configuration of it: load it into the model it was "
       "written for (resuming: start from a fresh checkpoint_dir)")


class TensorSource(ABC):
    """A model's tensors (and, for a checkpoint, its optimizer's state) by state_dict name."""

    model_keys: List[str]  # the model's state_dict names, in order (every name of a tied tensor)
    where: str = "the checkpoint"  # how error messages name the source

    # --- the model's tensors -------------------------------------------------------------------

    def aliases(self) -> Dict[str, List[str]]:
        """A tied tensor's first state_dict name -> all its names."""
        return {}

    @abstractmethod
    def holds(self, name: str) -> bool:
        """Whether the source has a tensor stored under ``name``."""

    def first_held(self, names: Sequence[str]) -> str:
        """The first of a tensor's names (a tied weight has several) the source holds."""
        for name in names:
            if self.holds(name):
                return name
        raise CheckpointError(f"{self.where} has no weights for {' / '.join(names)}: it holds another model")

    @abstractmethod
    def shape(self, name: str) -> Tuple[int, ...]:
        """The shape of the stored tensor ``name``."""

    def dtype(self, name: str) -> torch.dtype:
        """The dtype of the stored tensor ``name`` (here from the tensor itself; a source that can
        answer without reading it does)."""
        return self.full_tensor(name).dtype

    def numel(self, name: str) -> int:
        """How many elements the stored tensor ``name`` has."""
        return math.prod(self.shape(name))

    def check_shape(self, name: str, shape: Sequence[int]) -> None:
        """CheckpointError unless the stored tensor ``name`` has ``shape`` (this model's)."""
        stored = list(self.shape(name))
        if stored != list(shape):
            raise CheckpointError(f"{name} in {self.where} has shape {stored}, this model's {list(shape)}: {FIX}")

    def check_tensor(self, name: str, shape: Sequence[int], dtype: Any, cast: bool = False) -> None:
        """CheckpointError unless the stored tensor ``name`` has this model's ``shape`` and ``dtype``
        (a torch.dtype or its name, "float32"), checked before any of it is read.

        Args:
            name: the tensor's name in the source.
            shape: this model's shape of it.
            dtype: this model's dtype of it.
            cast: a floating-point tensor of another floating-point dtype is accepted too, converted
                as it is read (pretrained weights: bf16 into an fp32 model); a resumed checkpoint
                has this model's dtypes exactly (False).
        """
        mine = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        stored_shape, stored = list(self.shape(name)), self.dtype(name)
        fits = stored == mine or (cast and stored.is_floating_point and mine.is_floating_point)
        if stored_shape != list(shape) or not fits:
            raise CheckpointError(f"{name} in {self.where} is {_dtype_name(stored)} of shape {stored_shape}, this "
                                  f"model's {_dtype_name(mine)} of shape {list(shape)}: {FIX}")

    @abstractmethod
    def full_tensor(self, name: str) -> torch.Tensor:
        """The model's tensor ``name``, whole."""

    def read(self, name: str, start: int, stop: int, key: str = "") -> torch.Tensor:
        """Elements of a tensor flattened, or of its optimizer state: what a rank of a sharded strategy
        reads of its slice, without the rest where the source can. A range outside the stored tensor
        is refused before anything is read (a source reads through ``_read``, never past the tensor).

        Args:
            name: the tensor's state_dict name.
            start: the first element read.
            stop: the element after the last one read.
            key: an optimizer state entry of the tensor (Adam's ``exp_avg``); empty: the tensor itself.
        """
        numel = self.numel(name)
        if not 0 <= start <= stop <= numel:
            what = f"the optimizer's {key} of {name}" if key else name
            raise CheckpointError(f"elements [{start}, {stop}) of {what} asked of {self.where}, whose {name} has "
                                  f"{numel} (shape {list(self.shape(name))}): {FIX}")
        values = self._read(name, start, stop, key)
        io_watch.progress(values.numel() * values.element_size())  # a memory-mapped file's pages came in
        if values.numel() != stop - start:
            raise CheckpointError(f"{self.where} gave {values.numel()} elements of {name}{' ' + key if key else ''} "
                                  f"for [{start}, {stop}): its files do not fit together")
        return values

    def _read(self, name: str, start: int, stop: int, key: str) -> torch.Tensor:
        """``read``'s elements, the range checked against the stored tensor already."""
        whole = self.full_tensor(name) if not key else self._optimizer_entry(name, key)
        flat = whole.reshape(-1)
        if flat.numel() != self.numel(name):
            raise CheckpointError(f"the optimizer's {key} of {name} in {self.where} has {flat.numel()} elements, "
                                  f"the tensor {self.numel(name)}: {FIX}")
        return flat[start:stop].clone()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "read" in cls.__dict__:  # the range check is the contract's: a source implements _read
            raise TypeError(f"{cls.__name__} defines read(): a tensor source implements _read, which read() "
                            f"calls once the range is checked against the stored tensor")

    def read_slice(self, name: str, shard: Any) -> torch.Tensor:
        """A tensor-parallel rank's slice of tensor ``name`` (``shard``: its TensorShard)."""
        values = shard.take(self.full_tensor(name))
        io_watch.progress(values.numel() * values.element_size())
        return values

    def model_tensors(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """(first name, whole tensor) of every distinct tensor, in state_dict order, one at a time
        (an export: a tied weight once)."""
        later = {name for names in self.aliases().values() for name in names[1:]}
        for name in self.model_keys:
            if name not in later:
                yield name, self.full_tensor(name)

    def unmanaged(self) -> Dict[str, torch.Tensor]:
        """The buffers and the parameters the optimizer does not train, whole."""
        return {}

    # --- the optimizer's state (None: the source holds none) -----------------------------------

    def param_groups(self) -> Optional[List[Dict[str, Any]]]:
        """The parameter groups' hyperparameters, or None when the source holds no optimizer state."""
        return None

    def parameter_count(self) -> Optional[int]:
        """How many parameters the optimizer steps, or None when the source holds no optimizer state."""
        return None

    def optimizer_state(self, name: str) -> Optional[Dict[str, Any]]:
        """The optimizer's state of the parameter ``name``: its scalars, and per-element entries as
        tensors of their dtype whose elements ``read(name, start, stop, key)`` gives (whole or not);
        None when the source holds no optimizer state."""
        return None

    def optimizer_state_of(self, index: int, name: str) -> Optional[Dict[str, Any]]:
        """The full optimizer's state of its parameter ``index`` (named ``name``): per-element entries
        whole, scalars; None when the source holds no optimizer state."""
        return None

    def optimizer_parameter_names(self) -> Optional[List[str]]:
        """The optimizer's parameters by their first state_dict name, in its numbering (the
        ``index`` of optimizer_state_of); None when the source cannot name them (a full checkpoint
        knows them by index only) or holds no optimizer state."""
        return None

    def full_state(self) -> Dict[str, Any]:
        """The whole {"model", "optimizer"} state, as a gathered checkpoint holds it (the memory of
        all of it); "optimizer" None when the source holds no optimizer state."""
        return {"model": {name: self.full_tensor(name) for name in self.model_keys}, "optimizer": None}

    def held_state(self) -> Optional[Dict[str, Any]]:
        """The whole state when the source holds it in memory already (a full checkpoint: every rank
        has all of it), else None: reading it by slice would save nothing."""
        return None

    def check_flat_layout(self, layout: Mapping[str, Any]) -> None:
        """CheckpointError unless the source holds the model and optimizer a flat sharded strategy's
        ``layout`` describes (checked before any slice is read); nothing to check without an optimizer."""

    def _optimizer_entry(self, name: str, key: str) -> torch.Tensor:
        state = self.optimizer_state(name)
        if state is None:
            raise CheckpointError(f"{self.where} holds no optimizer state")
        return state[key]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")

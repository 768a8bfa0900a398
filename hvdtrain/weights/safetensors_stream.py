"""One safetensors file written a tensor at a time, so that the writer never holds more than the
tensor in hand: the model's export (model.safetensors, a Hugging Face directory's files) from
tensors that arrive one by one (``Strategy.full_tensors()``, a checkpoint read by slice).

safetensors puts a header with every tensor's name, dtype, shape and offsets before the data, and
the header is known only once the last tensor is. So the data go to a file beside the result as
they come; ``close()`` writes the header, then copies the data after it in blocks, into a file that
appears whole or not at all. The copy costs one more read and write of the data, not memory.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, BinaryIO, Dict, Iterable, List, Mapping, Optional

import torch

from hvdtrain.common import io_watch
from hvdtrain.common.atomic import write_atomically

# safetensors' names of torch's dtypes (its format's specification).
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL"}
_COPY_BLOCK = 16 * 2**20


class StreamedSafetensors:
    """``add()`` tensors one at a time, then ``close()`` (the file appears) or ``discard()``."""

    def __init__(self, path: Path, metadata: Optional[Mapping[str, str]] = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._data_path = self.path.with_name(f".{self.path.name}.data")
        self._data: Optional[BinaryIO] = open(self._data_path, "wb")
        self._header: Dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self.names: List[str] = []
        self.bytes = 0

    def add(self, tensor: torch.Tensor, names: Iterable[str]) -> int:
        """Write ``tensor`` under each of ``names`` (a tied weight under each of its names, as
        separate copies: safetensors refuses shared memory); returns the bytes written."""
        names = list(names)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"model state entry {names[0]!r} is a {type(tensor).__name__}, not a tensor: only tensors "
                            "can be exported")
        if tensor.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{', '.join(names)}: safetensors has no dtype {tensor.dtype}")
        # A copy on the host: numpy's view of a tensor makes its storage unresizable, and fsdp frees a
        # gathered unit (resizes its storage to 0) once the next tensor is asked for.
        raw = tensor.detach().to("cpu", copy=True).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        written = 0
        for name in names:
            if name in self._header:
                raise ValueError(f"{name} is written twice into {self.path}")
            with io_watch.watching(self.path, "write") as activity:  # the stall watchdog's view of it
                activity.counting(self._data).write(raw)
            self._header[name] = {"dtype": SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape),
                                  "data_offsets": [self.bytes, self.bytes + len(raw)]}
            self.names.append(name)
            self.bytes += len(raw)
            written += len(raw)
        return written

    def close(self) -> Path:
        """The header, then the data: the file at ``path``, whole."""
        self._data.close()
        self._data = None
        encoded = json.dumps(self._header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data start 8-byte aligned, as safetensors writes them

        def write(out: BinaryIO) -> None:
            out.write(len(encoded).to_bytes(8, "little"))
            out.write(encoded)
            with open(self._data_path, "rb") as data:
                shutil.copyfileobj(data, out, _COPY_BLOCK)
        try:
            write_atomically(self.path, write)
        finally:
            self._data_path.unlink(missing_ok=True)
        return self.path

    def discard(self) -> None:
        """Nothing is written (an error on the way): the data file goes."""
        if self._data is not None:
            self._data.close()
            self._data = None
        self._data_path.unlink(missing_ok=True)

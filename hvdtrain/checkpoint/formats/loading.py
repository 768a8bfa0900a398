"""Reading back what torch.save wrote, tensors and plain values only, and telling why a read failed.

Only corruption is corruption. A file whose bytes are not as written (a checksum that differs, a
file cut short or garbled) is set aside by a resume, which falls back to the previous checkpoint.
Anything else that stops a read leaves the checkpoint where it is and stops the run with one line
naming the cause and the file: ``weights_only`` refusing a type (the file is as written: it holds a
value a resume cannot read back), memory, an error of the file system. A file whose checksum was
checked before it was read (``verified``) cannot be garbled: any failure to read it is of the
second kind.

numpy numbers and arrays are common in a callback's state (a best metric from ``np.mean``): they
load (``NUMPY``: numpy's scalar and array reconstructors and its dtypes, which build numbers from
bytes and call nothing else; not object arrays). Any other value ``weights_only`` would refuse is
refused when it is saved (``check_loadable``), naming where it is, rather than found unreadable at
the next start.
"""
from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, List, Tuple

import numpy
import torch

from hvdtrain.checkpoint import CheckpointError, CorruptCheckpoint


def _numpy_globals() -> List[Any]:
    """numpy's reconstructors under the names pickles of numpy 1 (numpy.core) and 2 (numpy._core) give them."""
    multiarray = numpy._core.multiarray if hasattr(numpy, "_core") else numpy.core.multiarray
    found: List[Any] = [numpy.ndarray, numpy.dtype]
    # A dtype pickles as its class (numpy.dtypes.Float64DType, numpy >= 1.25) and that class's state.
    found += [kind for kind in vars(getattr(numpy, "dtypes", object)).values()
              if isinstance(kind, type) and issubclass(kind, numpy.dtype) and kind.__name__ != "ObjectDType"]
    for package in ("numpy.core", "numpy._core"):
        found += [(multiarray.scalar, f"{package}.multiarray.scalar"),
                  (multiarray._reconstruct, f"{package}.multiarray._reconstruct")]
    return found


NUMPY = _numpy_globals()


@contextmanager
def loadable_numpy() -> Iterator[None]:
    """Inside, ``torch.load(..., weights_only=True)`` reads numpy numbers and arrays too."""
    with torch.serialization.safe_globals(NUMPY):
        yield


def load(source: "Path | io.BytesIO", verified: bool, mmap: bool = False) -> Any:
    """What torch.save wrote to ``source`` (a file or bytes), tensors and plain values only.

    Raises CorruptCheckpoint when the file is garbled or cut short (only when not ``verified``),
    else CheckpointError naming the cause (module text).

    Args:
        source: the file (or bytes) to read.
        verified: its checksum matched its record before this read: it is as written.
        mmap: the tensors stay in the file until read.
    """
    try:
        with loadable_numpy():
            return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as error:  # noqa: BLE001 - every failure is told apart below
        raise read_failure(source, error, verified) from None


def read_failure(source: Any, error: BaseException, verified: bool) -> CheckpointError:
    """The error a failed read of ``source`` raises: CorruptCheckpoint only when its bytes are not
    as written; otherwise a CheckpointError that says it is intact and what to do."""
    name = source if isinstance(source, (str, Path)) else "the checkpoint's state"
    cause = f"{type(error).__name__}: {first_line(error)}"
    intact = ("its checksum matches what was written: it is intact, nothing was set aside"
              if verified else "its bytes may well be intact: nothing was set aside")
    if isinstance(error, MemoryError) or _out_of_memory(error):
        return CheckpointError(f"{name} could not be read: out of memory ({cause}); {intact}. Give this process more "
                               f"memory (or fewer processes per host), or save with checkpoint_format=sharded, which "
                               f"each rank reads a part of")
    if isinstance(error, OSError):
        return CheckpointError(f"{name} could not be read: the file system failed ({cause}); {intact}. Resume once "
                               f"the file system is back")
    if _refused_type(error):
        return CheckpointError(f"{name} holds a value a resume does not read back (weights_only: "
                               f"{refused_global(error)}); {intact}. It holds more than tensors and plain values (written "
                               f"by an hvdtrain before saves were checked for this, or not by hvdtrain): only if you "
                               f"trust where it came from, load it with torch.load(weights_only=False) and save it "
                               f"again without that value")
    if verified:
        return CheckpointError(f"{name} could not be read ({cause}); {intact}")
    return CorruptCheckpoint(f"{name} is unreadable ({cause})")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else ""


def _out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(
        words in text for words in ("not enough memory", "can't allocate memory", "out of memory", "bad_alloc"))


def _refused_type(error: BaseException) -> bool:
    return isinstance(error, pickle.UnpicklingError) and "Unsupported global" in str(error)


def refused_global(error: BaseException) -> str:
    """The global weights_only refused ("GLOBAL datetime.datetime"), from torch's message."""
    text = str(error)
    start = text.find("GLOBAL ")
    return text[start:].split(" was not", 1)[0] if start >= 0 else first_line(error)


# --- at save time ----------------------------------------------------------------------------

def check_loadable(state: Any, what: str) -> None:
    """CheckpointError naming the first value of ``state`` a resume could not read back under
    ``weights_only`` (``what`` names the state: "the checkpoint's state"), before it is written.
    Tensors and plain values are known to load; every other value is saved and loaded back alone,
    as a resume would (a few per save: a callback's numpy number), so the check costs a walk of the
    state's structure, not a second save."""
    for where, value in _values_to_try(state, ""):
        if not _round_trips(value):
            kind = type(value)
            raise CheckpointError(
                f"{what}{where} is a {kind.__module__}.{kind.__qualname__} ({_short_repr(value)}), which a resume "
                f"could not read back: checkpoints hold tensors and plain values only (numbers, strings, bytes, "
                f"lists, tuples, sets, dicts, numpy numbers and arrays), so that loading one never runs code. Return "
                f"plain values from that state_dict() (float(x), str(x), x.isoformat(), a tuple for a namedtuple), "
                f"or leave the value out")


# What weights_only loads as it is (tests/unit/test_loading.py checks each against torch).
PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray, torch.dtype, torch.Size, torch.device)


def _values_to_try(value: Any, where: str) -> Iterator[Tuple[str, Any]]:
    """(where, value) of every value inside ``value`` that is neither a plain tensor, a plain value,
    nor a plain container (walked into): the ones only a round trip can tell."""
    kind = type(value)
    if kind in (torch.Tensor, torch.nn.Parameter) or kind in PLAIN:
        return
    if kind in (dict, OrderedDict):
        for key, item in value.items():
            if type(key) not in PLAIN:
                yield f"{where} (a key)", key
            yield from _values_to_try(item, f"{where}[{key!r}]")
    elif kind in (list, tuple, set):
        for index, item in enumerate(value):
            yield from _values_to_try(item, f"{where}[{index}]")
    else:
        yield where, value


def _round_trips(value: Any) -> bool:
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception:  # noqa: BLE001 - not even picklable: a resume could not read it either
        return False
    buffer.seek(0)
    try:
        with loadable_numpy():
            torch.load(buffer, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        return False
    return True


def _short_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


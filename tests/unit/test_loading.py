"""Reading back what torch.save wrote (hvdtrain.checkpoint.formats.loading): what loads, what a save
refuses naming where it is, and which failures of a read are corruption (only garbled bytes)."""
import collections
import datetime
import errno
import io
import pickle
import re

import numpy
import pytest
import torch

from hvdtrain.checkpoint import CheckpointError, CorruptCheckpoint
from hvdtrain.checkpoint.formats import loading

PLAIN_EXAMPLES = {type(None): None, bool: True, int: 3, float: 0.5, complex: 1j, str: "s", bytes: b"b",
                  bytearray: bytearray(b"b"), torch.dtype: torch.bfloat16, torch.Size: torch.Size([2, 3]),
                  torch.device: torch.device("cpu")}


def saved(value) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def test_every_value_taken_as_plain_loads_under_weights_only_with_this_torch():
    """check_loadable trusts PLAIN without a round trip: a torch that stops loading one fails here."""
    assert set(PLAIN_EXAMPLES) == set(loading.PLAIN)
    for kind, value in PLAIN_EXAMPLES.items():
        loaded = torch.load(saved({"v": value, "in": [value, (value,)]}), weights_only=True)
        assert loaded["v"] == value and type(loaded["v"]) is kind


def test_numpy_numbers_and_arrays_load_as_themselves():
    state = {"best": numpy.float64(0.25), "f32": numpy.float32(1.5), "count": numpy.int64(7), "flag": numpy.bool_(True),
             "history": numpy.arange(6, dtype=numpy.float32).reshape(2, 3)}
    loading.check_loadable(state, "state")
    loaded = loading.load(saved(state), verified=True)
    for key, value in state.items():
        assert type(loaded[key]) is type(value) and numpy.array_equal(loaded[key], value), key
    assert loaded["history"].dtype == numpy.float32


@pytest.mark.parametrize("value,kind", [
    (datetime.datetime(2026, 11, 28), "datetime.datetime"),
    (collections.namedtuple("Point", "x y")(1, 2), "Point"),
    (collections.defaultdict(int), "collections.defaultdict"),
    (frozenset({1}), "builtins.frozenset"),
    (numpy.array([object()], dtype=object), "numpy.ndarray"),
])
def test_a_value_that_would_not_load_back_is_named_with_its_place(value, kind):
    state = {"model": {"w": torch.ones(2)}, "callbacks": [{}, {"Best": {"values": [1, value]}}]}
    with pytest.raises(CheckpointError, match=rf"^the checkpoint's state\['callbacks'\]\[1\]\['Best'\]\['values'\]\[1\] "
                                              rf"is a .*{kind} "):
        loading.check_loadable(state, "the checkpoint's state")


def test_a_key_that_would_not_load_back_is_named():
    with pytest.raises(CheckpointError, match=r"^state\['counts'\] \(a key\) is a datetime.date"):
        loading.check_loadable({"counts": {datetime.date(2026, 1, 1): 3}}, "state")


FAILURES = [
    (MemoryError(), "out of memory"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: not enough memory: you tried to allocate "
                  "8 bytes"), "out of memory"),
    (OSError(errno.EIO, "Input/output error"), "the file system failed"),
    (OSError(errno.ESTALE, "Stale file handle"), "the file system failed"),
    (pickle.UnpicklingError("Weights only load failed. WeightsUnpickler error: Unsupported global: GLOBAL "
                            "pandas.Timestamp was not an allowed global by default."),
     r"holds a value a resume does not read back \(weights_only: GLOBAL pandas.Timestamp\)"),
]


@pytest.mark.parametrize("verified", [True, False])
@pytest.mark.parametrize("error,cause", FAILURES)
def test_a_read_that_fails_for_another_reason_than_its_bytes_is_no_corruption(tmp_path, error, cause, verified):
    told = loading.read_failure(tmp_path / "ckpt-000000010.pt", error, verified)
    assert type(told) is CheckpointError and "nothing was set aside" in str(told)
    assert str(told).startswith(str(tmp_path / "ckpt-000000010.pt"))
    assert re.search(cause, str(told)), str(told)


def test_garbled_bytes_are_corruption_only_when_not_verified(tmp_path):
    path = tmp_path / "ckpt-000000010.pt"
    path.write_bytes(b"PK\x03\x04 not a zip archive at all")
    with pytest.raises(CorruptCheckpoint, match="is unreadable"):
        loading.load(path, verified=False)
    # Its checksum matched (verified): the bytes are as written, so whatever stops the read is not them.
    with pytest.raises(CheckpointError, match="its checksum matches what was written: it is intact") as told:
        loading.load(path, verified=True)
    assert not isinstance(told.value, CorruptCheckpoint)

"""Point-to-point between neighbouring stages through Horovod, which has no send or receive: in the
pair's 2-rank process set an ``hvd.alltoall`` with splits ``[0, n]`` / ``[n, 0]`` is an exchange
(each side sends what it has, or nothing, and gets the peer's). Every tensor travels as one row of
bytes behind a header of its dtype and shape, so any shape and dtype fits one collective. An
exchange is a rendezvous: both sides must issue the same exchanges in the same order (1F1B pairs
"send my activation" with "receive an earlier gradient"), under names both derive alone.
"""
from __future__ import annotations

import time
from typing import Optional, Tuple

import horovod.torch as hvd
import torch

from hvdtrain.parallel.mesh import Group, Mesh

# The dtypes an activation or its gradient may have, by code (the header carries the code).
DTYPES: Tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
)
_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}
HEADER_ITEM = 8  # bytes of one header value (int64)


def pack(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as one uint8 row: the header ``[dtype code, ndim, *shape]`` (int64), then its bytes."""
    if tensor.dtype not in _CODE:
        raise TypeError(f"a pipeline stage cannot send a {tensor.dtype} tensor; supported: {list(DTYPES)}")
    # On the tensor's device: torch.cat refuses a CPU header before a GPU tensor's bytes.
    header = torch.tensor([_CODE[tensor.dtype], tensor.dim(), *tensor.shape], dtype=torch.int64, device=tensor.device)
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    return torch.cat([header.view(torch.uint8), data])


def unpack(row: torch.Tensor) -> Optional[torch.Tensor]:
    """The tensor ``pack`` made of ``row``; None for an empty row (nothing was sent)."""
    if row.numel() == 0:
        return None
    code, ndim = row[: 2 * HEADER_ITEM].clone().view(torch.int64).tolist()
    end = (2 + ndim) * HEADER_ITEM
    shape = row[2 * HEADER_ITEM : end].clone().view(torch.int64).tolist()
    # clone: a fresh, aligned buffer (and a leaf the next stage may set requires_grad on).
    return row[end:].clone().view(DTYPES[code]).reshape(shape)


def exchange(group: Group, send: Optional[torch.Tensor], name: str,
             device: torch.device = torch.device("cpu")) -> Optional[torch.Tensor]:
    """Send ``send`` (or nothing) to the other rank of the 2-rank ``group`` and return what it
    sent (or None). Both ranks call it with the same ``name``; it returns when both did.

    One alltoall of bytes: each side's tensor travels with its own header (dtype code, ndim,
    shape), so the receiver needs to know nothing in advance, and both ways share the call
    whatever their dtypes.

    Args:
        group: the 2-rank group.
        send: the tensor to send, or None.
        name: the collective's name, the same on both ranks.
        device: the stage's, where an empty row (nothing to send) is made: Horovod refuses a collective whose ranks'
            tensors are on different kinds of device (CPU on one, GPU on the other).
    """
    if group.size != 2 or group.process_set is None:
        raise ValueError(f"point-to-point needs a pair of ranks with a process set, got {group!r}")
    row = torch.empty(0, dtype=torch.uint8, device=device) if send is None else pack(send)
    splits = [0, 0]
    splits[1 - group.index] = row.numel()  # everything to the peer, nothing to this rank
    received, _ = hvd.alltoall(row, splits=torch.tensor(splits, dtype=torch.int32), name=name,
                               process_set=group.process_set)
    return unpack(received)


class StageLinks:
    """This stage's links to its neighbours in the pipeline, with the time spent waiting in them.

    ``forward`` is the direction of activations (stage s -> s + 1), ``backward`` of their
    gradients (s + 1 -> s). Each method is one exchange on one pair; its name says which
    micro-batches move, so that both sides of the pair name it alike.
    """

    def __init__(self, mesh: Mesh, device: torch.device = torch.device("cpu")) -> None:
        self.next_pair, self.prev_pair = mesh.next_pair, mesh.prev_pair
        self.device = device  # the stage's: what it sends and receives lives there
        self.step = 0
        self.wait_s = 0.0

    def _name(self, pair: Group, forward: Optional[int], backward: Optional[int]) -> str:
        moves = ".".join(part for part in (
            None if forward is None else f"f{forward}", None if backward is None else f"b{backward}") if part)
        return f"pp.{self.step}.{pair.ranks[0]}-{pair.ranks[1]}.{moves}"

    def _exchange(self, pair: Group, send: Optional[torch.Tensor], forward: Optional[int],
                  backward: Optional[int]) -> Optional[torch.Tensor]:
        start = time.perf_counter()
        try:
            return exchange(pair, send, self._name(pair, forward, backward), self.device)
        finally:
            self.wait_s += time.perf_counter() - start

    # Towards the next stage (nothing on the last).
    def send_forward(self, activation: torch.Tensor, micro_batch: int) -> None:
        if self.next_pair is not None:
            self._exchange(self.next_pair, activation, micro_batch, None)

    def recv_backward(self, micro_batch: int) -> Optional[torch.Tensor]:
        if self.next_pair is None:
            return None
        return self._exchange(self.next_pair, None, None, micro_batch)

    def send_forward_recv_backward(self, activation: torch.Tensor, forward_mb: int,
                                   backward_mb: int) -> Optional[torch.Tensor]:
        if self.next_pair is None:
            return None
        return self._exchange(self.next_pair, activation, forward_mb, backward_mb)

    # Towards the previous stage (nothing on the first).
    def recv_forward(self, micro_batch: int) -> Optional[torch.Tensor]:
        if self.prev_pair is None:
            return None
        return self._exchange(self.prev_pair, None, micro_batch, None)

    def send_backward(self, gradient: Optional[torch.Tensor], micro_batch: int) -> None:
        if self.prev_pair is not None:
            self._exchange(self.prev_pair, gradient, None, micro_batch)

    def send_backward_recv_forward(self, gradient: Optional[torch.Tensor], backward_mb: int,
                                   forward_mb: int) -> Optional[torch.Tensor]:
        if self.prev_pair is None:
            return None
        return self._exchange(self.prev_pair, gradient, forward_mb, backward_mb)


class ChunkLinks:
    """Point-to-point between the stages of chunks that follow one another, for schedules given as
    action lists (actions.py): the interleaved ones, where chunk P·k - 1 on the last stage feeds
    chunk P·k on the first (over ``mesh.ends``), and the zero-bubble one.

    A send is posted and not waited for (``hvd.alltoall_async``: the receiver's empty row meets it
    by name whenever the receiver gets there); a receive waits. The action lists are proved free of
    deadlock under exactly this rule (actions.simulate). ``finish`` waits for the sends still out.
    """

    def __init__(self, mesh: Mesh, device: torch.device, step: object) -> None:
        self.stage, self.stages = mesh.stage, mesh.shape.pipeline
        self.pairs = {self.stage + 1: mesh.next_pair, self.stage - 1: mesh.prev_pair}
        if self.stages > 2 and self.stage in (0, self.stages - 1):  # the wrap-around of the interleaved order
            self.pairs[(self.stage + 1) % self.stages if self.stage else self.stages - 1] = mesh.ends
        self.device, self.step = device, step
        self.sent: list = []  # (handle, row): the row lives until its send is done
        self.wait_s = 0.0

    def _pair(self, peer: int) -> Group:
        pair = self.pairs.get(peer)
        if pair is None or pair.process_set is None:
            raise ValueError(f"pipeline stage {self.stage} has no link to stage {peer}")
        return pair

    def _name(self, pair: Group, what: str) -> str:
        return f"pp.{self.step}.{pair.ranks[0]}-{pair.ranks[1]}.{what}"

    def send(self, tensor: Optional[torch.Tensor], peer: int, what: str) -> None:
        """Post ``tensor`` (None: an empty row) to stage ``peer`` under ``what`` (the receiver names it alike)."""
        pair = self._pair(peer)
        row = torch.empty(0, dtype=torch.uint8, device=self.device) if tensor is None else pack(tensor)
        splits = [0, 0]
        splits[1 - pair.index] = row.numel()
        handle = hvd.alltoall_async(row, splits=torch.tensor(splits, dtype=torch.int32), name=self._name(pair, what),
                                    process_set=pair.process_set)
        self.sent.append((handle, row))

    def recv(self, peer: int, what: str) -> Optional[torch.Tensor]:
        """What stage ``peer`` sent under ``what``, waited for."""
        pair = self._pair(peer)
        start = time.perf_counter()
        try:
            row = torch.empty(0, dtype=torch.uint8, device=self.device)
            handle = hvd.alltoall_async(row, splits=torch.tensor([0, 0], dtype=torch.int32),
                                        name=self._name(pair, what), process_set=pair.process_set)
            received, _ = hvd.synchronize(handle)
            return unpack(received)
        finally:
            self.wait_s += time.perf_counter() - start

    def finish(self) -> None:
        """Wait for every send still out (the receivers have them, or will)."""
        start = time.perf_counter()
        for handle, _ in self.sent:
            hvd.synchronize(handle)
        self.sent = []
        self.wait_s += time.perf_counter() - start

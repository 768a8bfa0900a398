"""Runs one stage's action list (actions.py) over its chunks: the interleaved 1F1B and the
zero-bubble schedules.

``F`` runs a chunk forward on the micro-batch's input (the first chunk's) or on what the previous
chunk's stage sent, and posts its output to the next chunk's stage; the last chunk computes the
loss instead. ``B`` takes the gradient the next chunk's stage sent (the last chunk: its loss) and
posts its input's gradient back.

The zero-bubble split: ``B`` asks autograd only for the gradients of the chunk's input and of each
layer's output (``torch.autograd.grad``, graph kept), which needs no weight gradient; ``W`` later
runs each layer's own part of the graph from its output's gradient to its parameters
(``torch.autograd.backward(..., inputs=params)``), accumulating into ``.grad``. Both sum the
same products as one backward, in a different order: equal to float64 rounding.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.pipeline.actions import Action
from hvdtrain.parallel.pipeline.p2p import ChunkLinks


class _Held:
    """A micro-batch's pass through a chunk, between its F and its last backward pass."""

    def __init__(self, x: Optional[torch.Tensor], outputs: List[torch.Tensor], out: torch.Tensor) -> None:
        self.x, self.outputs, self.out = x, outputs, out
        self.weight_work: List[Tuple[torch.Tensor, Optional[torch.Tensor], List[torch.Tensor]]] = []


class ChunkRunner:
    """One schedule run on one stage that holds one or more chunks.

    Args:
        stage: this rank's PipelineStage (its ``chunk_layers``).
        mesh: the mesh.
        micro_batches: the batch's micro-batches ((inputs, targets[, extras])).
        loss_fn: the last chunk's loss on a micro-batch.
        links: the chunk links of this run.
        measure: what the last chunk measures beside the loss, or None.
        shares: ``loss_fn`` gives shares of the batch's loss (summed), else micro-batch means (averaged).
        split: B finds only the input's gradient, W passes the weights' (the zero-bubble schedule).
    """

    def __init__(self, stage: Any, mesh: Mesh, micro_batches: Sequence[Tuple[Any, ...]],
                 loss_fn: Callable, links: ChunkLinks, measure: Any, shares: bool, split: bool) -> None:
        self.stage, self.mesh, self.micro_batches, self.loss_fn = stage, mesh, micro_batches, loss_fn
        self.links, self.measure, self.shares, self.split = links, measure, shares, split
        self.stages = mesh.shape.pipeline
        self.last = self.stages * stage.virtual - 1
        self.held: Dict[Tuple[int, int], _Held] = {}
        self.losses: List[torch.Tensor] = []
        self.measured: List[torch.Tensor] = []
        self.compute_s = 0.0
        self.max_in_flight = 0

    def run(self, actions: Sequence[Action]) -> None:
        for action in actions:
            {"F": self.forward, "B": self.backward, "W": self.weight}[action.kind](action)
        self.links.finish()

    def forward(self, action: Action) -> None:
        i, g = action.micro_batch, action.chunk
        micro = self.micro_batches[i]
        received = None if g == 0 else self.links.recv((g - 1) % self.stages, f"F{i}.{g}")
        start = time.perf_counter()
        x = micro[0] if g == 0 else received.requires_grad_(True)
        outputs: List[torch.Tensor] = []
        out = self.stage.run_chunk(g, x, micro[2] if len(micro) > 2 else None, outputs)
        if g == self.last:
            # The loss first, then the measure: a step_fn's metrics come out of the same call as its loss.
            loss = self.loss_fn(out, micro[1])
            if not self.shares:
                loss = loss / len(self.micro_batches)
            if self.measure is not None:
                self.measured.append(self.measure.fn(out.detach(), micro[1]))
            self.losses.append(loss.detach())
            out = loss
        self.held[(i, g)] = _Held(None if g == 0 else x, outputs, out)
        self.max_in_flight = max(self.max_in_flight, len(self.held))
        self.compute_s += time.perf_counter() - start
        if g < self.last:
            self.links.send(out.detach(), (g + 1) % self.stages, f"F{i}.{g + 1}")

    def backward(self, action: Action) -> None:
        """The whole backward, or with W passes in the list only the input's (and the layers' outputs') gradients."""
        i, g = action.micro_batch, action.chunk
        gradient = None if g == self.last else self.links.recv((g + 1) % self.stages, f"B{i}.{g}")
        start = time.perf_counter()
        held = self.held[(i, g)]
        if not self.split:
            del self.held[(i, g)]
            torch.autograd.backward(held.out, gradient)
            result = None if held.x is None else (torch.zeros_like(held.x) if held.x.grad is None else held.x.grad)
        else:
            result = self._input_gradient(held, gradient, g)
        self.compute_s += time.perf_counter() - start
        if g > 0:
            self.links.send(result, (g - 1) % self.stages, f"B{i}.{g - 1}")

    def _input_gradient(self, held: _Held, gradient: Optional[torch.Tensor], chunk: int) -> Optional[torch.Tensor]:
        """The gradients of the chunk's input and of its layers' outputs (the graph kept for W); what
        each layer's W needs is stored beside the held pass."""
        outputs, last = held.outputs, chunk == self.last
        # The outputs whose gradient B finds: every layer's but the last (whose is ``gradient``), and
        # on the last chunk the last's too (the loss comes after it).
        inner = outputs if last else outputs[:-1]
        wanted = ([held.x] if held.x is not None else []) + [o for o in inner if o.requires_grad]
        found = torch.autograd.grad(held.out, wanted, None if last else gradient, retain_graph=True,
                                    allow_unused=True) if wanted else ()
        grads = {id(t): g for t, g in zip(wanted, found)}
        for layer, output in zip(self.stage.chunk_layers[chunk], outputs):
            params = [p for p in layer.parameters() if p.requires_grad]
            if not params or not output.requires_grad:
                continue
            grad = gradient if (output is outputs[-1] and not last) else grads.get(id(output))
            if grad is not None:
                held.weight_work.append((output, grad, params))
        if held.x is None:
            return None
        grad = grads.get(id(held.x))
        return torch.zeros_like(held.x) if grad is None else grad

    def weight(self, action: Action) -> None:
        """The parameters' gradients of micro-batch ``i``'s pass through the chunk, from the layers' output gradients B kept."""
        start = time.perf_counter()
        held = self.held.pop((action.micro_batch, action.chunk))
        for output, grad, params in held.weight_work:
            torch.autograd.backward(output, grad, inputs=params, retain_graph=True)
        self.compute_s += time.perf_counter() - start

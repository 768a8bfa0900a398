"""Pipeline parallelism: a model's layers cut into contiguous stages, one per rank of a pipeline, run
over micro-batches by GPipe (every forward, then every backward: M micro-batches held) or 1F1B
(PipeDream-Flush: at most P held). Both have the bubble (P - 1) / (M + P - 1) and the same gradient,
that of the mean loss. Two schedules with less bubble run as action lists (actions.py, executor.py):
the interleaved 1F1B (v chunks per stage: (P - 1) / (v·M + P - 1)) and ZB-H1 (the backward split
into the input's gradient and the weights', the latter deferred into the bubble: about a third of
1F1B's). A parameter in two stages (a tied embedding) is a copy on each end; their gradients are
summed over ``mesh.ends`` so both step alike.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import horovod.torch as hvd
import torch
from torch import nn

from hvdtrain.common.stage_split import contiguous_stages
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.pipeline.actions import schedule_actions
from hvdtrain.parallel.pipeline.executor import ChunkRunner
from hvdtrain.parallel.pipeline.p2p import ChunkLinks, StageLinks

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
# (inputs, targets) or (inputs, targets, extras): extras (a dict batch's attention mask) go to the
# layers that take them (``takes_extras``) on every stage.
MicroBatch = Tuple[Any, ...]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Measure(NamedTuple):
    """What the last stage measures beside the loss: ``fn(outputs, targets)`` gives a micro-batch's
    float64 vector of one value per name in ``names`` (NaN: not measured for it). Every stage knows
    the names, so the values travel with the loss in one broadcast."""

    names: Tuple[str, ...]
    fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

    def read(self, values: torch.Tensor) -> Dict[str, torch.Tensor]:
        """The measured ones by name (the same on every stage: they came in one broadcast)."""
        return {name: value for name, value in zip(self.names, values) if not torch.isnan(value)}


def from_last_stage(mesh: Mesh, name: str, device: torch.device, measure: Optional[Measure],
                    loss: Optional[torch.Tensor],
                    measured: Optional[torch.Tensor]) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """(the loss, the metrics by name) as the last stage of this pipeline computed them, on every stage:
    one broadcast over ``mesh.pipeline``, in float64 (the other stages receive into zeros on their
    own device: one device kind per collective).

    Args:
        mesh: the mesh; the broadcast runs over ``mesh.pipeline``.
        name: the collective's name.
        device: this stage's device, where the other stages receive.
        measure: what the last stage measures beside the loss, or None.
        loss: the loss on the last stage, None on the others.
        measured: ``measure``'s values on the last stage, None on the others.
    """
    summary = torch.zeros(1 + (len(measure.names) if measure is not None else 0), dtype=torch.float64, device=device)
    if loss is not None:
        summary[0] = loss
        if measured is not None:
            summary[1:] = measured
    if mesh.pipeline.process_set is not None:
        # Distributed: the loss and the metrics from the last stage to every stage of this pipeline.
        summary = hvd.broadcast(summary, root_rank=mesh.pipeline.ranks[-1], name=name,
                                process_set=mesh.pipeline.process_set)
    return summary[0], measure.read(summary[1:]) if measure is not None else {}


# ---- splitting ---------------------------------------------------------------------------------

def _parameter_count(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def split_layers(layers: Sequence[nn.Module], stages: int, plan: Optional[Sequence[int]] = None) -> List[List[int]]:
    """The indices of ``layers`` each stage holds: contiguous, every stage at least one layer,
    balanced by parameter count, or ``plan[s]`` layers in stage ``s`` when a plan is given."""
    return contiguous_stages([_parameter_count(layer) for layer in layers], stages, plan)


def split_micro_batches(batch: Sequence[torch.Tensor], micro_batches: int) -> List[MicroBatch]:
    """``batch`` (inputs, targets, ...: tensors of one batch size) cut into ``micro_batches``
    equal micro-batches along the first dimension."""
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"micro-batches must be a whole number >= 1, got {micro_batches!r}")
    size = len(batch[0])
    if any(len(t) != size for t in batch):
        raise ValueError(f"the batch's tensors have different sizes: {[len(t) for t in batch]}")
    if size % micro_batches:
        raise ValueError(f"{micro_batches} micro-batches do not divide the batch of {size}: choose a number "
                         f"of micro-batches that divides {size}, or a batch size that is a multiple of {micro_batches}")
    return list(zip(*(t.chunk(micro_batches) for t in batch)))


# ---- the stage ---------------------------------------------------------------------------------

@dataclass
class ScheduleStats:
    """One run of a schedule on one stage: seconds computing (forward and backward), seconds in
    point-to-point exchanges (waiting for a neighbour included), and the most micro-batches whose
    activations the stage held at once."""

    schedule: str = ""
    micro_batches: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    max_in_flight: int = 0


class PipelineStage(nn.Module):
    """This rank's share of ``layers`` (the model's full layer list, the same on every rank of the
    pipeline), and the parameters it shares with other stages.

    With ``virtual`` = v > 1 the layers are cut into P·v contiguous chunks and this stage holds
    chunks ``stage``, ``stage + P``, ...: the interleaved schedule's layout (``plan``, when given,
    lists the P·v chunks' layer counts).

    Args:
        layers: the model's layers, in order.
        mesh: the mesh; its pipeline axis gives the stages.
        plan: layers per stage (per chunk when v > 1), or None: balanced by parameter count.
        virtual: v, chunks per stage.
    """

    def __init__(self, layers: Sequence[nn.Module], mesh: Mesh, plan: Optional[Sequence[int]] = None,
                 virtual: int = 1) -> None:
        super().__init__()
        stages = mesh.shape.pipeline
        if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1:
            raise ValueError(f"pipeline_virtual_stages must be a whole number >= 1, got {virtual!r}")
        if plan is not None and virtual > 1 and len(plan) != stages * virtual:
            raise ValueError(f"with pipeline_virtual_stages={virtual} the stage plan lists the layers of each of the "
                             f"{stages} x {virtual} = {stages * virtual} chunks, got {len(plan)} entries")
        if virtual > 1 and len(layers) < stages * virtual:
            raise ValueError(f"{len(layers)} layers cannot fill {stages} stages x {virtual} virtual stages: every chunk "
                             f"needs a layer; lower pipeline_virtual_stages")
        self.stage, self.stages, self.virtual = mesh.stage, stages, virtual
        self.assignment = split_layers(layers, stages * virtual, plan)  # by chunk; chunk g on stage g % P
        self.chunks = [c * stages + self.stage for c in range(virtual)]
        self.indices = [i for g in self.chunks for i in self.assignment[g]]
        self.layers = nn.ModuleList(layers[i] for i in self.indices)
        # Each chunk's layers (the same modules as self.layers, not registered twice).
        self.chunk_layers = {g: [layers[i] for i in self.assignment[g]] for g in self.chunks}
        self.tied = self._tied_parameters(layers)
        self.stats = ScheduleStats()
        self.metrics: Dict[str, torch.Tensor] = {}  # the last run's (run_schedule's measure)
        self.step = 0  # schedules run, part of every collective's name

    def _tied_parameters(self, layers: Sequence[nn.Module]) -> List[nn.Parameter]:
        """This stage's parameters that another stage holds too (by identity, in a fixed order)."""
        owners: Dict[int, List[int]] = {}
        order: Dict[int, nn.Parameter] = {}
        for chunk, indices in enumerate(self.assignment):
            stage = chunk % self.stages
            for i in indices:
                for p in layers[i].parameters():
                    stages = owners.setdefault(id(p), [])
                    if stage not in stages:
                        stages.append(stage)
                    order.setdefault(id(p), p)
        tied = []
        for key, stages in owners.items():
            if len(stages) < 2:
                continue
            if sorted(stages) != [0, self.stages - 1]:
                raise ValueError(
                    f"a parameter of shape {tuple(order[key].shape)} is shared by pipeline stages {stages}: "
                    f"only the first and the last stage may share parameters (a tied embedding); "
                    f"move the layers that use it into those stages with a plan")
            if self.stage in stages:
                tied.append(order[key])
        return tied

    def forward(self, x: torch.Tensor, extras: Optional[Dict[str, torch.Tensor]] = None) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, extras) if getattr(layer, "takes_extras", False) else layer(x)
        return x

    def run_chunk(self, chunk: int, x: torch.Tensor, extras: Optional[Dict[str, torch.Tensor]] = None,
                  outputs: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """Chunk ``chunk``'s layers on ``x``; each layer's output appended to ``outputs`` when given
        (where the zero-bubble schedule splits the backward).

        Args:
            chunk: the global chunk's index, one of this stage's ``chunks``.
            x: its input.
            extras: what layers that take extras get (an attention mask), or None.
            outputs: a list each layer's output is appended to, or None.
        """
        for layer in self.chunk_layers[chunk]:
            x = layer(x, extras) if getattr(layer, "takes_extras", False) else layer(x)
            if outputs is not None:
                outputs.append(x)
        return x

    def reduce_tied_gradients(self, mesh: Mesh, before: List[Optional[torch.Tensor]], name: str) -> None:
        """Sum over ``mesh.ends`` what this schedule added to the tied parameters' gradients
        (``before``: each gradient when it started), so both copies get the full gradient."""
        if not self.tied or mesh.ends is None or mesh.ends.process_set is None:
            return
        for i, (p, old) in enumerate(zip(self.tied, before)):
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            added = grad if old is None else grad - old
            # Distributed: the tied copies' gradients summed over the first and last stage.
            total = hvd.allreduce(added, op=hvd.Sum, name=f"{name}.tied{i}", process_set=mesh.ends.process_set)
            p.grad = total if old is None else old + total


# ---- the schedules -----------------------------------------------------------------------------

class _Runner:
    """One schedule run on one stage: forward and backward of single micro-batches, and the
    activations held between them."""

    def __init__(self, stage: PipelineStage, mesh: Mesh, micro_batches: List[MicroBatch], loss_fn: LossFn,
                 links: StageLinks, measure: Optional[Measure], shares: bool) -> None:
        self.stage, self.mesh, self.micro_batches, self.loss_fn = stage, mesh, micro_batches, loss_fn
        self.links, self.measure, self.shares = links, measure, shares
        self.held: Dict[int, Tuple[Optional[torch.Tensor], torch.Tensor]] = {}  # micro-batch -> (input, output)
        self.losses: List[torch.Tensor] = []
        self.measured: List[torch.Tensor] = []
        self.compute_s = 0.0
        self.max_in_flight = 0

    def forward(self, i: int, received: Optional[torch.Tensor]) -> torch.Tensor:
        start = time.perf_counter()
        if self.mesh.is_first_stage:
            x = self.micro_batches[i][0]
        else:
            x = received.requires_grad_(True)
        micro = self.micro_batches[i]
        out = self.stage(x, micro[2] if len(micro) > 2 else None)
        if self.mesh.is_last_stage:
            targets = self.micro_batches[i][1]
            # The loss first, then the measure: a step_fn's metrics come out of the same call as its loss.
            loss = self.loss_fn(out, targets)
            if not self.shares:
                loss = loss / len(self.micro_batches)
            if self.measure is not None:
                self.measured.append(self.measure.fn(out.detach(), targets))
            self.losses.append(loss.detach())
            out = loss
        self.held[i] = (None if self.mesh.is_first_stage else x, out)
        self.max_in_flight = max(self.max_in_flight, len(self.held))
        self.compute_s += time.perf_counter() - start
        return out.detach()

    def backward(self, i: int, gradient: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Backward of micro-batch ``i`` (from its loss on the last stage, else from the gradient
        the next stage sent); the gradient of its input for the previous stage (None on the first)."""
        start = time.perf_counter()
        x, out = self.held.pop(i)
        if self.mesh.is_last_stage:
            out.backward()
        else:
            torch.autograd.backward(out, gradient)
        result = None
        if x is not None:
            result = torch.zeros_like(x) if x.grad is None else x.grad
        self.compute_s += time.perf_counter() - start
        return result


def _gpipe(run: _Runner) -> None:
    links, m = run.links, len(run.micro_batches)
    for i in range(m):
        out = run.forward(i, links.recv_forward(i))
        links.send_forward(out, i)
    for i in range(m):
        links.send_backward(run.backward(i, links.recv_backward(i)), i)


def _one_f_one_b(run: _Runner) -> None:
    links, m = run.links, len(run.micro_batches)
    warmup = min(run.mesh.shape.pipeline - 1 - run.mesh.stage, m)
    steady = m - warmup
    # Warm-up: fill the pipe with forwards.
    for i in range(warmup):
        links.send_forward(run.forward(i, links.recv_forward(i)), i)
    # Steady state: one forward, one backward; each exchange moves one micro-batch each way.
    received = links.recv_forward(warmup) if steady else None
    for k in range(steady):
        forward_mb, backward_mb = warmup + k, k
        out = run.forward(forward_mb, received)
        gradient = links.send_forward_recv_backward(out, forward_mb, backward_mb)
        input_gradient = run.backward(backward_mb, gradient)
        if k == steady - 1:
            links.send_backward(input_gradient, backward_mb)
        else:
            received = links.send_backward_recv_forward(input_gradient, backward_mb, forward_mb + 1)
    # Cool-down: drain the backwards.
    for i in range(steady, m):
        links.send_backward(run.backward(i, links.recv_backward(i)), i)


_SCHEDULES = {"gpipe": _gpipe, "1f1b": _one_f_one_b}


def run_schedule(schedule: str, stage: PipelineStage, mesh: Mesh, micro_batches: Sequence[MicroBatch],
                 loss_fn: LossFn, measure: Optional[Measure] = None, shares: bool = False) -> torch.Tensor:
    """Forward and backward of every micro-batch through the pipeline by the schedule; a collective over
    ``mesh.pipeline`` (and ``mesh.ends``). Gradients accumulate in the stage's ``.grad`` (the caller
    zeroes them). Returns the mean loss over the micro-batches (float64, detached), the same on every
    stage; ``stage.stats`` holds the run's timings and ``stage.metrics`` what was measured, the mean
    over the micro-batches (equal in size), by name, the same on every stage.

    Every stage passes the same number of micro-batches; the first stage uses their inputs, the
    last their targets, the others only their count.

    Args:
        schedule: gpipe, 1f1b (interleaved when the stage holds several chunks) or zb-h1.
        stage: this rank's stage.
        mesh: the mesh; its pipeline group runs the schedule.
        micro_batches: the batch's micro-batches.
        loss_fn: a micro-batch's mean loss (the batch's is the mean over the micro-batches), or with ``shares`` its
            share of the batch's.
        measure: what the last stage measures beside the loss, or None.
        shares: ``loss_fn`` gives shares, summed: a token mean over the whole batch, Hugging Face's num_items_in_batch.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    micro_batches = list(micro_batches)
    if not micro_batches:
        raise ValueError("run_schedule needs at least one micro-batch")
    device = micro_batches[0][0].device  # the loop moved the batch to this rank's device, on every stage
    links = StageLinks(mesh, device)
    links.step = stage.step
    name = f"pp.{stage.step}"
    stage.step += 1
    before = [None if p.grad is None else p.grad.clone() for p in stage.tied]
    if schedule == "zb-h1" or stage.virtual > 1:
        # Every rank derives every stage's list alike: refusals (micro-batches not a multiple of P) before any exchange.
        actions = schedule_actions(schedule, mesh.shape.pipeline, stage.virtual, len(micro_batches))[mesh.stage]
        links = ChunkLinks(mesh, device, stage.step - 1)
        run = ChunkRunner(stage, mesh, micro_batches, loss_fn, links, measure, shares, split=schedule == "zb-h1")
        run.run(actions)
    else:
        run = _Runner(stage, mesh, micro_batches, loss_fn, links, measure, shares)
        _SCHEDULES[schedule](run)
    wait_s = links.wait_s
    start = time.perf_counter()
    # Distributed: the tied parameters' gradients summed over the first and last stage.
    stage.reduce_tied_gradients(mesh, before, name)
    wait_s += time.perf_counter() - start
    loss, stage.metrics = from_last_stage(mesh, f"{name}.loss", device, measure,
                                          torch.stack(run.losses).sum() if run.losses else None,
                                          torch.stack(run.measured).mean(dim=0) if run.measured else None)
    stage.stats = ScheduleStats(schedule, len(micro_batches), run.compute_s, wait_s, run.max_in_flight)
    return loss

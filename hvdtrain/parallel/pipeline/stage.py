"""The Trainer's view of a pipeline: one training batch through the schedule, one evaluation batch
forward through the stages, each returning the batch's loss and metrics on every rank of the pipeline.

Every rank of a pipeline reads the same batch (the data is sharded over data-parallel groups, not
over stages): the first stage uses its inputs, the last its targets. The metrics are those the
Trainer's step reports without a pipeline (hvdtrain.components.steps.supervised_step): the last stage
measures them, and they travel with the loss. A dict batch (Hugging Face labels) reports its loss,
the model's own (hf_step), and the metrics of a step_fn that returns ``model(**batch).loss``.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.parallel.pipeline.hf_layers import hf_pipeline_layers
from hvdtrain.parallel.pipeline.hf_plan import HFPipelinePlan, hf_pipeline_plan, is_hf_causal_lm
from hvdtrain.parallel.pipeline.hf_step import ModelLoss, StageStep, dict_micro_batches
from hvdtrain.parallel.pipeline.p2p import ChunkLinks, StageLinks
from hvdtrain.parallel.pipeline.schedule import (Measure, PipelineStage, from_last_stage, run_schedule,
                                                 split_micro_batches)
from hvdtrain.components import token_mean
from hvdtrain.components.steps import class_accuracy

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    accuracy = class_accuracy(outputs, targets)
    if accuracy is None:
        return torch.full((1,), float("nan"), dtype=torch.float64, device=outputs.device)
    return accuracy.reshape(1)


# supervised_step's metrics, measured on the last stage.
SUPERVISED = Measure(("accuracy",), _accuracy)


def _as_pair(batch: Any) -> Tuple[torch.Tensor, torch.Tensor]:
    if not (isinstance(batch, (tuple, list)) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise TypeError(f"a pipeline takes (inputs, targets) batches of two tensors, or dict batches with input_ids "
                        f"and labels, got a {type(batch).__name__}: the first stage reads the inputs and the last "
                        f"computes loss_fn(outputs, targets)")
    return batch[0], batch[1]


def _micro_batches(batch: Any, count: int) -> List[Tuple[Any, ...]]:
    """(inputs, targets) pairs, or for a dict batch (a tokenized dataset's: input_ids, labels and an
    optional attention_mask) (input_ids, the micro-batch as a dict, {"attention_mask": ...}), cut
    into ``count``."""
    if isinstance(batch, Mapping):
        return dict_micro_batches(batch, count)
    return split_micro_batches(_as_pair(batch), count)


class _LastStageStep(NamedTuple):
    """How the last stage turns a micro-batch's output into its loss (``shares``: each micro-batch's
    share of the batch's, summed; else its mean, averaged) and what it measures beside."""

    loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]
    measure: Optional[Measure]
    shares: bool


def _target_shares(loss_fn: LossFn, targets_of: Callable[[Any], torch.Tensor],
                   targets: torch.Tensor) -> Optional[Callable[[torch.Tensor, Any], torch.Tensor]]:
    """For a cross-entropy-like ``loss_fn`` (a mean over the targets it does not ignore), each
    micro-batch's loss as its share of the batch's token mean (its mean x its targets / the batch's),
    as one pass over the whole batch computes it; None for a loss of another kind (equal
    micro-batches: the mean of their means is the batch's). Counted on the device: no wait."""
    ignore = token_mean.ignore_index_of(loss_fn)
    if ignore is None or targets.is_floating_point():
        return None
    total = (targets != ignore).sum().clamp_min(1)

    def share(out: torch.Tensor, micro: Any) -> torch.Tensor:
        mine = targets_of(micro)
        return loss_fn(out, mine) * ((mine != ignore).sum() / total)
    return share


def _is_default_step(step_fn: Any) -> bool:
    return step_fn is None or hasattr(step_fn, "supervised_loss_fn")


class PipelinedModel:
    """This rank's stage of the pipeline and how batches go through it.

    Args:
        stage: this rank's stage.
        mesh: the mesh.
        loss_fn: the last stage's loss function.
        micro_batches: micro-batches per batch.
        schedule: gpipe, 1f1b or zb-h1.
        model: the whole model's object, for its loss_function and config.
    """

    def __init__(self, stage: PipelineStage, mesh: Mesh, loss_fn: LossFn, micro_batches: int, schedule: str,
                 model: nn.Module) -> None:
        self.module, self.mesh, self.loss_fn = stage, mesh, loss_fn
        self.micro_batches, self.schedule = micro_batches, schedule
        self.__dict__["model"] = model  # the whole model's object: its loss_function and config

    def train_batch(self, batch: Any, autocast, weight: Any = 1.0, step_fn: Any = None) -> Tuple[torch.Tensor, Dict]:
        """Forward and backward of the batch's micro-batches by the schedule; the gradients of the loss
        times ``weight`` accumulate. Returns (the batch's loss, unweighted; its metrics: the means over
        the micro-batches).

        Args:
            batch: the batch, cut into micro-batches here.
            autocast: the forward's precision context.
            weight: the batch's share of the step (hvdtrain.components.token_mean): 1 / accumulation, or
                its scored items x the replicas / the global batch's, read (``float``) at the last stage's
                first loss, after its forward.
            step_fn: a user's step function run on the last stage (None: ``loss_fn`` on the logits).
        """
        micro = _micro_batches(batch, self.micro_batches)
        step = self._step_for(batch, micro, step_fn)  # every rank, before any exchange: refusals alike
        if isinstance(weight, float) and weight == 1:
            with autocast():
                loss = run_schedule(self.schedule, self.module, self.mesh, micro, step.loss_fn, step.measure,
                                    step.shares)
            return loss, self.module.metrics
        read: List[float] = []

        def weighted(out: Any, target: Any) -> torch.Tensor:
            if not read:
                read.append(float(weight))
            return step.loss_fn(out, target) * read[0]
        with autocast():
            loss = run_schedule(self.schedule, self.module, self.mesh, micro, weighted, step.measure, step.shares)
        weight = float(weight)
        # A batch that scores nothing has weight 0 and no loss to report (the loop weighs it 0).
        return (loss / weight if weight else torch.zeros_like(loss)), self.module.metrics

    def _step_for(self, batch: Any, micro: List[Tuple[Any, ...]], step_fn: Any) -> _LastStageStep:
        """(inputs, targets): the Trainer's loss_fn and supervised_step's metrics. A dict batch: the
        model's own loss (transformers' loss_function over the batch's label tokens) when the Trainer
        was given no loss_fn of its own, else loss_fn(logits, labels); a user's step_fn run on the
        last stage against the stage's output (hf_step)."""
        if not isinstance(batch, Mapping):
            if not _is_default_step(step_fn):
                raise ValueError("a step_fn under train.pipeline_parallel takes dict batches (input_ids, labels, "
                                 "attention_mask) and returns model(**batch).loss; with (inputs, targets) batches pass "
                                 "loss_fn instead")
            shares = _target_shares(self.loss_fn, lambda targets: targets, _as_pair(batch)[1])
            return _LastStageStep(shares or self.loss_fn, SUPERVISED, shares is not None)
        if _is_default_step(step_fn) and self.loss_fn is not F.cross_entropy:
            shares = _target_shares(self.loss_fn, lambda micro: micro["labels"], batch["labels"])
            return (_LastStageStep(shares, None, True) if shares is not None else
                    _LastStageStep(lambda out, micro: self.loss_fn(out, micro["labels"]), None, False))
        model_loss = ModelLoss(self.model, batch["labels"])
        if _is_default_step(step_fn):
            return _LastStageStep(lambda out, micro: model_loss(out, micro["labels"]), None, True)
        dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), torch.get_default_dtype())
        step = StageStep(step_fn, model_loss, [piece[1] for piece in micro], model_loss.vocab_size, dtype)
        return _LastStageStep(step, step.measure, True)

    @torch.no_grad()
    def evaluate_batch(self, batch: Any, step_fn: Any = None) -> Tuple[torch.Tensor, Dict]:
        """The batch forward through the stages (one micro-batch: no backward to overlap), its loss
        and metrics from the last stage on every rank of the pipeline."""
        micro = _micro_batches(batch, 1)
        (inputs, targets, *extras), = micro
        step = self._step_for(batch, micro, step_fn)
        stage, mesh = self.module, self.mesh
        if stage.virtual > 1:
            out = self._forward_chunks(inputs, extras[0] if extras else None)
        else:
            links = StageLinks(mesh, inputs.device)
            links.step = f"eval{stage.step}"
            received = links.recv_forward(0)
            out = stage(inputs if mesh.is_first_stage else received, extras[0] if extras else None)
            links.send_forward(out, 0)
        step_name = f"eval{stage.step}"
        stage.step += 1
        loss = measured = None
        if mesh.is_last_stage:  # the loss first: a step_fn's metrics come with it
            loss = step.loss_fn(out, targets)
            measured = step.measure.fn(out, targets) if step.measure is not None else None
        return from_last_stage(mesh, f"pp.{step_name}.loss", inputs.device, step.measure, loss, measured)

    def _forward_chunks(self, inputs: Any, extras: Optional[Dict[str, torch.Tensor]]) -> Optional[torch.Tensor]:
        """The batch through every chunk in turn (interleaved stages): this stage runs its chunks as
        their turn comes; the last chunk's output on the last stage, None elsewhere."""
        stage, mesh = self.module, self.mesh
        links = ChunkLinks(mesh, inputs.device, f"eval{stage.step}")
        last = mesh.shape.pipeline * stage.virtual - 1
        out = None
        for g in stage.chunks:
            x = inputs if g == 0 else links.recv((g - 1) % mesh.shape.pipeline, f"F0.{g}")
            out = stage.run_chunk(g, x, extras)
            if g < last:
                links.send(out, (g + 1) % mesh.shape.pipeline, f"F0.{g + 1}")
        links.finish()
        return out


def probe_model(model: nn.Module, plan: ModelPlan) -> Optional[HFPipelinePlan]:
    """Where a Hugging Face causal LM cuts (hf_plan), when no pipeline_layers are given: probed on
    the whole model, before tensor parallelism splits it; refused by name before any step."""
    if plan.pipeline_layers is not None or isinstance(model, nn.Sequential) or not is_hf_causal_lm(model):
        return None
    return hf_pipeline_plan(model)


def build_stage(model: nn.Module, plan: ModelPlan, mesh: Mesh, loss_fn: LossFn, micro_batches: int,
                schedule: str, hf_plan: Optional[HFPipelinePlan] = None, virtual_stages: int = 1) -> PipelinedModel:
    """Cut the model into the mesh's stages and keep this rank's.

    Args:
        model: the whole model.
        plan: its layers (``plan.pipeline_layers(model)``, or an nn.Sequential's children) and their cut
            (``plan.stage_layers``, else balanced by parameter count).
        mesh: the mesh; its pipeline axis gives the stages.
        loss_fn: the last stage's loss function.
        micro_batches: micro-batches per batch.
        schedule: gpipe, 1f1b or zb-h1.
        hf_plan: a Hugging Face causal LM's layers, probe_model's (None: not one).
        virtual_stages: model chunks per stage (v > 1: interleaved 1f1b; the layers cut into P x v chunks).
    """
    if plan.pipeline_layers is not None:
        layers = list(plan.pipeline_layers(model))
    elif isinstance(model, nn.Sequential):
        layers = list(model.children())
    elif hf_plan is not None or is_hf_causal_lm(model):  # its own forward around its decoder layers
        layers = hf_pipeline_layers(model, hf_plan)
    else:
        raise ValueError(f"train.pipeline_parallel={mesh.shape.pipeline} needs the model as a sequence of layers: "
                         f"an nn.Sequential, a Hugging Face causal LM, or Trainer(..., model_plan=ModelPlan(pipeline_layers=fn)) "
                         f"where fn(model) returns its layers in order ({type(model).__name__} is none of them; the "
                         f"example transformer's is hvdtrain.examples.textlm_parallel.pipeline_layers)")
    if loss_fn is None:
        raise ValueError("a pipeline computes loss_fn(outputs, targets) on its last stage: pass loss_fn")
    stage = PipelineStage(layers, mesh, plan.stage_layers, virtual=virtual_stages)
    return PipelinedModel(stage, mesh, loss_fn, micro_batches, schedule, model)

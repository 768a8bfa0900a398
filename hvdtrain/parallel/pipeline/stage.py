"""The Trainer's view of a pipeline: one training batch through the schedule, one evaluation batch
forward through the stages, each returning the batch's loss and metrics on every rank of the pipeline.

Every rank of a pipeline reads the same batch (the data is sharded over data-parallel groups, not
over stages): the first stage uses its inputs, the last its targets. The metrics are those the
Trainer's step reports without a pipeline (hvdtrain.training.steps.supervised_step): the last stage
measures them, and they travel with the loss. A dict batch (Hugging Face labels) reports the loss only.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.model_plan import ModelPlan
from hvdtrain.parallel.pipeline.hf_layers import causal_lm_loss, hf_decoder, hf_pipeline_layers
from hvdtrain.parallel.pipeline.p2p import StageLinks
from hvdtrain.parallel.pipeline.schedule import (Measure, PipelineStage, from_last_stage, run_schedule,
                                                 split_micro_batches)
from hvdtrain.training.steps import class_accuracy

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
    optional attention_mask) (input_ids, labels, {"attention_mask": ...}), cut into ``count``."""
    if not isinstance(batch, Mapping):
        return split_micro_batches(_as_pair(batch), count)
    missing = [key for key in ("input_ids", "labels") if key not in batch]
    if missing:
        raise TypeError(f"a pipeline's dict batch needs input_ids (for the first stage) and labels (for the "
                        f"last stage's loss); this one has no {', '.join(missing)} (it has {', '.join(batch)})")
    tensors = [batch["input_ids"], batch["labels"]]
    if batch.get("attention_mask") is not None:
        tensors.append(batch["attention_mask"])
    pieces = split_micro_batches(tensors, count)
    return [(ids, labels, {"attention_mask": piece[0]} if piece else None) for ids, labels, *piece in pieces]


class PipelinedModel:
    """This rank's stage of the pipeline and how batches go through it."""

    def __init__(self, stage: PipelineStage, mesh: Mesh, loss_fn: LossFn, micro_batches: int, schedule: str) -> None:
        self.module, self.mesh, self.loss_fn = stage, mesh, loss_fn
        self.micro_batches, self.schedule = micro_batches, schedule

    def train_batch(self, batch: Any, autocast, divisor: int) -> Tuple[torch.Tensor, Dict]:
        """Forward and backward of the batch's micro-batches by the schedule; the gradients of
        ``loss / divisor`` (the accumulation count) accumulate. Returns (the batch's mean loss, its
        metrics: the means over the micro-batches)."""
        micro = _micro_batches(batch, self.micro_batches)
        own = self._loss_for(batch)
        loss_fn = own if divisor == 1 else (lambda out, target: own(out, target) / divisor)
        with autocast():
            loss = run_schedule(self.schedule, self.module, self.mesh, micro, loss_fn, self._measure_for(batch))
        return loss * divisor if divisor > 1 else loss, self.module.metrics

    def _loss_for(self, batch: Any) -> LossFn:
        """A dict batch's labels are Hugging Face's (the model shifts them, -100 ignored): its causal LM
        loss, unless the Trainer was given a loss_fn of its own (not the default cross-entropy)."""
        if isinstance(batch, Mapping) and self.loss_fn is F.cross_entropy:
            return causal_lm_loss
        return self.loss_fn

    @staticmethod
    def _measure_for(batch: Any) -> Optional[Measure]:
        """supervised_step's metrics for (inputs, targets); none for a dict batch (the Trainer's own
        step takes one only under a pipeline: there is nothing to report alike)."""
        return None if isinstance(batch, Mapping) else SUPERVISED

    @torch.no_grad()
    def evaluate_batch(self, batch: Any) -> Tuple[torch.Tensor, Dict]:
        """The batch forward through the stages (one micro-batch: no backward to overlap), its loss
        and metrics from the last stage on every rank of the pipeline."""
        (inputs, targets, *extras), = _micro_batches(batch, 1)
        stage, mesh = self.module, self.mesh
        links = StageLinks(mesh, inputs.device)
        links.step = f"eval{stage.step}"
        stage.step += 1
        received = links.recv_forward(0)
        out = stage(inputs if mesh.is_first_stage else received, extras[0] if extras else None)
        links.send_forward(out, 0)
        measure = self._measure_for(batch)
        last = mesh.is_last_stage
        return from_last_stage(mesh, f"pp.{links.step}.loss", inputs.device, measure,
                               self._loss_for(batch)(out, targets) if last else None,
                               measure.fn(out, targets) if last and measure is not None else None)


def build_stage(model: nn.Module, plan: ModelPlan, mesh: Mesh, loss_fn: LossFn, micro_batches: int,
                schedule: str) -> PipelinedModel:
    """Cut ``model`` into the mesh's stages (``plan.pipeline_layers(model)``, or an nn.Sequential's
    children; ``plan.stage_layers`` or balanced by parameter count) and keep this rank's."""
    if plan.pipeline_layers is not None:
        layers = list(plan.pipeline_layers(model))
    elif isinstance(model, nn.Sequential):
        layers = list(model.children())
    elif hf_decoder(model) is not None:  # a Hugging Face causal LM: embedding, decoder layers, norm + head
        layers = hf_pipeline_layers(model)
    else:
        raise ValueError(f"train.pipeline_parallel={mesh.shape.pipeline} needs the model as a sequence of layers: "
                         f"an nn.Sequential, a Hugging Face causal LM, or Trainer(..., model_plan=ModelPlan(pipeline_layers=fn)) "
                         f"where fn(model) returns its layers in order ({type(model).__name__} is none of them; the "
                         f"example transformer's is hvdtrain.examples.textlm_parallel.pipeline_layers)")
    if loss_fn is None:
        raise ValueError("a pipeline computes loss_fn(outputs, targets) on its last stage: pass loss_fn")
    stage = PipelineStage(layers, mesh, plan.stage_layers)
    return PipelinedModel(stage, mesh, loss_fn, micro_batches, schedule)

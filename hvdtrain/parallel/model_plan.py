"""How one model replica is split over a model-parallel mesh: the user's plan.

``tensor_plan`` maps module paths to split styles (hvdtrain.parallel.tensor.plan, which lists them; a Hugging Face model's own
``tp_plan`` is used when none is given);
``pipeline_layers(model)`` returns the model as a sequence of layers for the pipeline (default:
an nn.Sequential's children); ``stage_layers`` gives the layers per stage (default: balanced by
parameter count). The schedule and micro-batches are settings (train.pipeline_schedule,
train.micro_batches), not part of the model's plan.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Sequence

if TYPE_CHECKING:
    from torch import nn

TensorPlan = Dict[str, str]
PipelineLayers = Callable[["nn.Module"], List["nn.Module"]]


@dataclass(frozen=True)
class ModelPlan:
    tensor_plan: Optional[TensorPlan] = None
    pipeline_layers: Optional[PipelineLayers] = None
    stage_layers: Optional[Sequence[int]] = None

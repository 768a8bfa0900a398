"""``hvdtrain plan`` and ``hvdtrain bench project``'s models, MODELLED, NOT MEASURED: the layouts a
setup admits (layout.py: data, tensor, pipeline, sequence and expert parallelism), memory per rank
(memory.py), step time (step_time.py), the plan that ranks them (plan.py); the model's shape and how
hvdtrain cuts it (model_shape.py); the network and time terms shared with the data-parallel
projection calibrated on published figures (network.py, projection.py). This module re-exports the
planner's API.

Pure arithmetic, no torch at import (login nodes run it); imports common/ (and, inside functions,
hvdtrain's own stage split and the example's shape).
"""
from hvdtrain.planner.layout import (DEFAULT_FLOPS, DEFAULT_UPDATE_BANDWIDTH, FSDP_UNITS_HELD, OPTIMIZERS, PRECISIONS,
                                     STRATEGIES, Estimate, Layout, Setup, layouts)
from hvdtrain.planner.memory import memory, sharded_state_bytes, state_bytes_per_parameter
from hvdtrain.planner.model_shape import ModelShape, stage_elements, stage_layers
from hvdtrain.planner.network import LABEL, NETWORKS
from hvdtrain.planner.plan import NothingFits, Plan, fewest_workers, format_count, make_plan
from hvdtrain.planner.step_time import allreduce_s, estimate, update_bytes_per_element

__all__ = ["DEFAULT_FLOPS", "DEFAULT_UPDATE_BANDWIDTH", "FSDP_UNITS_HELD", "LABEL", "NETWORKS", "OPTIMIZERS", "PRECISIONS", "STRATEGIES",
           "Estimate", "Layout", "ModelShape", "NothingFits", "Plan", "Setup", "allreduce_s", "estimate",
           "fewest_workers", "format_count", "layouts", "make_plan", "memory", "sharded_state_bytes",
           "stage_elements", "stage_layers", "state_bytes_per_parameter", "update_bytes_per_element"]

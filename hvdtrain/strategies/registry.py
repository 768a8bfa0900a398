"""The strategies by name, and the one place their capabilities are read.

Each strategy class declares what it cannot be combined with, and why, as a class attribute
(``Strategy.refuses``); the settings' checks (``check_settings``, called when a TrainConfig is
created) and a launch's (``launch_refusal``) read it here. Importing this module is light: a class
is imported when it is chosen or its capabilities are read.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

if TYPE_CHECKING:
    import torch

    from hvdtrain.config.train import TrainConfig
    from hvdtrain.distributed.world import World
    from hvdtrain.parallel.mesh import Mesh
    from hvdtrain.parallel.model_plan import ModelPlan
    from hvdtrain.strategies.base import Strategy
    from hvdtrain.strategies.deferred_init import DeferredInit

# train.strategy -> "module:class"
STRATEGIES: Dict[str, str] = {
    "ddp": "hvdtrain.strategies.ddp:DDPStrategy",
    "zero1": "hvdtrain.strategies.zero:Zero1Strategy",
    "zero2": "hvdtrain.strategies.zero:Zero2Strategy",
    "fsdp": "hvdtrain.strategies.fsdp.strategy:FSDPStrategy",
    "ps": "hvdtrain.strategies.ps:PSStrategy",
}
STRATEGY_NAMES = tuple(STRATEGIES)
# Chosen by the mesh (train.tensor_parallel x pipeline_parallel > 1), over one of the above.
MODEL_PARALLEL = "hvdtrain.strategies.model_parallel:ModelParallelStrategy"

# The capabilities, each with the settings that ask for it and how a refusal says the way out.
ELASTIC, COMPILE, ADASUM, SHARDED_CHECKPOINTS, MESH = "elastic", "compile", "adasum", "sharded_checkpoints", "mesh"
ASKED: Dict[str, Callable[["TrainConfig"], bool]] = {
    COMPILE: lambda config: config.compile,
    ADASUM: lambda config: config.reduction == "adasum",
    SHARDED_CHECKPOINTS: lambda config: config.checkpoint_format == "sharded",
    MESH: lambda config: config.model_parallel,
}


# What a model-parallel layout refuses, named as the settings say it, and what to do instead.
LAYOUT_WAY_OUT = {
    SHARDED_CHECKPOINTS: ("checkpoint_format=sharded", "use checkpoint_format=full"),
    ADASUM: ("reduction=adasum", "use reduction=average"),
    COMPILE: ("compile", "set compile=false"),
}


def _load(path: str) -> type:
    module, cls = path.split(":")
    return getattr(importlib.import_module(module), cls)


def strategy_class(name: str) -> type:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}: choose one of {', '.join(STRATEGY_NAMES)}")
    return _load(STRATEGIES[name])


def supporting(capability: str) -> List[str]:
    """The strategies that support ``capability``, in the registry's order."""
    return [name for name in STRATEGY_NAMES if strategy_class(name).supports(capability)]


def _either(names: List[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _refusal(capability: str, name: str, why: str) -> str:
    """The message of strategy ``name`` refusing ``capability``, with the way out."""
    ok = _either(supporting(capability))
    if capability == COMPILE:
        return (f"TrainConfig.strategy={name} does not work with compile=true: {why}. Use compile with "
                f"{ok}, or {name} without compile")
    if capability == ADASUM:
        return (f"TrainConfig.strategy={name} does not work with reduction=adasum: reduction=adasum works only "
                f"with strategy={ok}, got strategy={name}: {why}. Use strategy={ok} with reduction=adasum, or "
                f"reduction=average with strategy={name}")
    if capability == SHARDED_CHECKPOINTS:
        return (f"TrainConfig.strategy={name} does not work with checkpoint_format=sharded: checkpoint_format="
                f"sharded needs a strategy that shards the state ({ok}), got strategy={name}: {why}. Use "
                f"checkpoint_format=full with {name}, or {ok} with checkpoint_format=sharded")
    raise ValueError(f"no refusal message for {capability}")


def check_settings(config: "TrainConfig") -> None:
    """ValueError, with the reason and the way out, when the configured strategy (or, under tensor or
    pipeline parallelism, the model-parallel layout) cannot do what the other settings ask."""
    cls = strategy_class(config.strategy)
    if config.model_parallel:
        layout = f"tensor_parallel={config.tensor_parallel} x pipeline_parallel={config.pipeline_parallel}"
        if not cls.supports(MESH):
            raise ValueError(f"TrainConfig.{layout} does not work with strategy={config.strategy}: "
                             f"{cls.refuses[MESH]}; use strategy={_either(supporting(MESH))}")
        layered = _load(MODEL_PARALLEL)
        for capability, (setting, way_out) in LAYOUT_WAY_OUT.items():
            if ASKED[capability](config) and not layered.supports(capability):
                raise ValueError(f"TrainConfig.{layout} does not work with {setting}: {layered.refuses[capability]}; "
                                 f"{way_out}")
    # Over a mesh the layout writes the sharded checkpoints (its slices and stages), whatever the data groups run.
    own = (COMPILE, ADASUM) if config.model_parallel else (COMPILE, ADASUM, SHARDED_CHECKPOINTS)
    for capability in own:
        if ASKED[capability](config) and not cls.supports(capability):
            raise ValueError(_refusal(capability, config.strategy, cls.refuses[capability]))


def launch_refusal(config: "TrainConfig", world: "World", elastic: bool) -> Optional[str]:
    """Why the configured strategy cannot run in this launch, or None; decided alike on every rank,
    before any collective, instead of failing or hanging in the first step."""
    if elastic:
        cls = _load(MODEL_PARALLEL) if config.model_parallel else strategy_class(config.strategy)
        if not cls.supports(ELASTIC):
            what = ("train.tensor_parallel / pipeline_parallel do not" if config.model_parallel
                    else f"train.strategy={config.strategy} does not")
            also = "" if config.model_parallel else f"use {_either(supporting(ELASTIC))} under elastic, or "
            return f"{what} support Horovod elastic ({cls.refuses[ELASTIC]}): {also}launch without --min-np/--max-np"
        if cls.elastic_from_checkpoint and not config.checkpoint_dir:
            return (f"train.strategy={config.strategy} under Horovod elastic continues from the newest checkpoint "
                    "after a world change (a lost worker takes its shard of the optimizer state along): set "
                    "train.checkpoint_dir, on storage every host reads")
    if config.reduction == "adasum":
        from hvdtrain.distributed import collectives
        from hvdtrain.strategies.reduction import adasum_refusal

        return adasum_refusal(world.size, world.local_size, world.cross_size, collectives.mpi_enabled(),
                              world.device.type == "cuda" and collectives.nccl_built(), collectives.homogeneous())
    return None


def build_strategy(config: "TrainConfig", model: "torch.nn.Module", optimizer: "torch.optim.Optimizer",
                   world: "World", mesh: "Optional[Mesh]" = None, plan: "Optional[ModelPlan]" = None,
                   loss_fn: Optional[Callable] = None, deferred: "Optional[DeferredInit]" = None) -> "Strategy":
    """The strategy ``config`` asks for, over ``model`` and ``optimizer``; with a model-parallel
    ``mesh``, config.strategy over each data-parallel group of split replicas (``plan`` says how to
    split them, ``loss_fn`` is a pipeline's last stage's). Each class reads its own settings.
    ``deferred``: the model was built on the meta device; a strategy that initializes by shard
    (``initializes_by_shard``) takes it, the others get the model made whole first."""
    cls = _load(MODEL_PARALLEL) if mesh is not None else strategy_class(config.strategy)
    if deferred is not None and not cls.initializes_by_shard:
        deferred.make_whole()
        deferred = None
    return cls.from_config(config, model, optimizer, world, mesh=mesh, plan=plan, loss_fn=loss_fn,
                           deferred=deferred)

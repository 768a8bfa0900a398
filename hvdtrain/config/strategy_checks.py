"""Whether the chosen strategy (or, under tensor or pipeline parallelism, the model-parallel layout)
can do what the other settings ask: read from the capabilities table, so that a TrainConfig is
checked on a login node without importing torch or Horovod."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, List

from hvdtrain.common import layout_rules
from hvdtrain.common.capabilities import (ADASUM, COMPILE, DECLARED, MESH, MODEL_PARALLEL, SHARDED_CHECKPOINTS,
                                          supporting)

if TYPE_CHECKING:
    from hvdtrain.config.train import TrainConfig

# Each capability a strategy may refuse, with the settings that ask for it.
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


def either(names: List[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _refusal(capability: str, name: str, why: str) -> str:
    """The message of strategy ``name`` refusing ``capability``, with the way out."""
    ok = either(supporting(capability))
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


def check_strategy_settings(config: "TrainConfig") -> None:
    """ValueError, with the reason and the way out, when the configured strategy (or, under tensor or
    pipeline parallelism, the model-parallel layout) cannot do what the other settings ask."""
    chosen = DECLARED[config.strategy]
    if config.model_parallel:
        layout = f"tensor_parallel={config.tensor_parallel} x pipeline_parallel={config.pipeline_parallel}"
        settings = {"tensor_parallel": config.tensor_parallel, "pipeline_parallel": config.pipeline_parallel}
        refused = layout_rules.refusals({**settings, "strategy": config.strategy}, of=layout_rules.TENSOR
                                        if config.tensor_parallel > 1 else layout_rules.PIPELINE)
        refused = [pair for pair in refused if pair[1] == config.strategy]
        if refused:  # the mesh's data groups under this strategy: hvdtrain.common.layout_rules
            raise ValueError(layout_rules.message(*refused[0], settings))
        layered = DECLARED[MODEL_PARALLEL]
        for capability, (setting, way_out) in LAYOUT_WAY_OUT.items():
            if ASKED[capability](config) and not layered.supports(capability):
                raise ValueError(f"TrainConfig.{layout} does not work with {setting}: {layered.refuses[capability]}; "
                                 f"{way_out}")
    # Over a mesh the layout writes the sharded checkpoints (its slices and stages), whatever the data groups
    # run; under expert parallelism its strategy does (each expert once), which its own checks judge.
    layered = config.model_parallel or config.expert_parallel > 1
    own = (COMPILE, ADASUM) if layered else (COMPILE, ADASUM, SHARDED_CHECKPOINTS)
    for capability in own:
        if ASKED[capability](config) and not chosen.supports(capability):
            raise ValueError(_refusal(capability, config.strategy, chosen.refuses[capability]))

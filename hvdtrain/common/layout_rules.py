"""Which parallel dimensions and strategies combine: one table, each refusal with its reason and the way out.

The dimensions are the settings that split the work over ranks (train.tensor_parallel,
pipeline_parallel, sequence_parallel, expert_parallel); the strategies are train.strategy's values,
which spread the rest of the state over the data-parallel ranks (hsdp's shard groups included). For
every pair the table says combined (``COMBINED``) or refused (``Refused(reason, way_out)``). Every
reader asks it: the settings' checks (hvdtrain.config.train, hvdtrain.config.strategy_checks), the
capabilities' mesh refusals (hvdtrain.common.capabilities), the planner's layouts
(hvdtrain.planner.layout), the topology that builds the process sets (hvdtrain.parallel.topology),
``hvdtrain check-layout`` and the docs' table (docs/concepts/model-parallelism.md, checked by
tests/unit/test_layout_rules.py).

Flipping one combination is one line of ``RULES``: a strategy's way out, when not written, lists the
strategies the dimension combines with, so it follows. Imports nothing (neither torch nor Horovod),
like hvdtrain.common.capabilities: a TrainConfig is checked on a login node.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Sequence, Tuple

TENSOR, PIPELINE, SEQUENCE, EXPERT = "tensor_parallel", "pipeline_parallel", "sequence_parallel", "expert_parallel"
DIMENSIONS = (TENSOR, PIPELINE, SEQUENCE, EXPERT)
# train.strategy's values, in hvdtrain.common.capabilities' order (tests/unit/test_layout_rules.py holds them equal).
STRATEGIES = ("ddp", "zero1", "zero2", "fsdp", "hsdp", "ps")
# The mesh's dimensions: refused alike, named together (tensor_parallel=T x pipeline_parallel=P).
MESH_DIMENSIONS = (TENSOR, PIPELINE)


@dataclasses.dataclass(frozen=True)
class Refused:
    """Why two settings do not combine, and what to do instead (None: for a strategy, ``use strategy=`` the
    strategies the dimension combines with). ``{strategies}`` in the reason is that list too."""

    reason: str
    way_out: Optional[str] = None


COMBINED = None

_SHARDED_MESH = ("zero2, fsdp and ps cut the state over every rank, and the model-parallel layout averages "
                 "gradients over each data-parallel group")
_SEQUENCE_SUMS = "the sequence groups' ranks reduce gradients as data-parallel ranks under {strategies}"
_EXPERT_MESH = Refused("expert parallelism does not combine with tensor or pipeline parallelism yet",
                       "set tensor_parallel and pipeline_parallel to 1, or expert_parallel=1")

# (dimension, dimension or strategy) -> COMBINED or Refused. Every pair is listed (a test holds it so).
RULES: Dict[Tuple[str, str], Optional[Refused]] = {
    (TENSOR, PIPELINE): COMBINED,
    (TENSOR, SEQUENCE): COMBINED,  # the sequence groups inside the data axis, around the tensor groups
    (TENSOR, EXPERT): _EXPERT_MESH,
    (PIPELINE, SEQUENCE): Refused("a pipeline's stages pass whole micro-batches, and its schedule does not yet cut "
                                  "their sequences", "use sequence_parallel with tensor_parallel or a data-parallel "
                                                     "strategy"),
    (PIPELINE, EXPERT): _EXPERT_MESH,
    (SEQUENCE, EXPERT): Refused("the router's load-balancing loss would be computed per part of each sequence, not "
                                "over the sequence as one process does", "set expert_parallel=1 or "
                                                                         "sequence_parallel=1"),
    # The mesh's data groups: plain replicas, or ZeRO-1 over each data group.
    (TENSOR, "ddp"): COMBINED,
    (TENSOR, "zero1"): COMBINED,
    (TENSOR, "zero2"): Refused(_SHARDED_MESH),
    (TENSOR, "fsdp"): Refused(_SHARDED_MESH),
    (TENSOR, "hsdp"): Refused(_SHARDED_MESH),
    (TENSOR, "ps"): Refused(_SHARDED_MESH),
    (PIPELINE, "ddp"): COMBINED,
    (PIPELINE, "zero1"): COMBINED,
    (PIPELINE, "zero2"): Refused(_SHARDED_MESH),
    (PIPELINE, "fsdp"): Refused(_SHARDED_MESH),
    (PIPELINE, "hsdp"): Refused(_SHARDED_MESH),
    (PIPELINE, "ps"): Refused(_SHARDED_MESH),
    # A sequence group's ranks are data-parallel ranks: the strategy sums their partial gradients.
    (SEQUENCE, "ddp"): COMBINED,
    (SEQUENCE, "zero1"): COMBINED,
    (SEQUENCE, "zero2"): COMBINED,
    (SEQUENCE, "fsdp"): COMBINED,
    (SEQUENCE, "hsdp"): Refused(_SEQUENCE_SUMS),
    (SEQUENCE, "ps"): Refused(_SEQUENCE_SUMS),
    # The rest of a mixture of experts: replicated (ddp), ZeRO's buckets or fsdp's units, the experts outside them.
    (EXPERT, "ddp"): COMBINED,
    (EXPERT, "zero1"): COMBINED,
    (EXPERT, "zero2"): COMBINED,
    (EXPERT, "fsdp"): COMBINED,
    (EXPERT, "hsdp"): Refused("its shard and replica groups are not built around expert groups yet"),
    (EXPERT, "ps"): Refused("its servers step every parameter for the whole world, and a rank's experts are its own"),
}


def _key(a: str, b: str) -> Tuple[str, str]:
    if (a, b) in RULES:
        return (a, b)
    if (b, a) in RULES:
        return (b, a)
    raise KeyError(f"no layout rule for {a} with {b}: known {', '.join(DIMENSIONS + STRATEGIES)}")


def rule(a: str, b: str) -> Optional[Refused]:
    """COMBINED (None) or the refusal of ``a`` with ``b``, in either order."""
    return RULES[_key(a, b)]


def combines(a: str, b: str) -> bool:
    return rule(a, b) is None


def strategies_with(*dimensions: str) -> Tuple[str, ...]:
    """The strategies every one of ``dimensions`` combines with, in STRATEGIES' order."""
    return tuple(s for s in STRATEGIES if all(combines(d, s) for d in dimensions))


def either(names: Sequence[str]) -> str:
    """``a``, ``a or b``, ``a, b or c``."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def reason(a: str, b: str) -> str:
    """Why ``a`` and ``b`` do not combine (ValueError when they do)."""
    refused = rule(a, b)
    if refused is None:
        raise ValueError(f"{a} combines with {b}")
    dimension = a if a in DIMENSIONS else b
    return refused.reason.format(strategies=", ".join(strategies_with(dimension)))


def way_out(a: str, b: str) -> str:
    """What to do instead of ``a`` with ``b``."""
    refused = rule(a, b)
    if refused is None:
        raise ValueError(f"{a} combines with {b}")
    if refused.way_out is not None:
        return refused.way_out
    dimension, strategy = (a, b) if b in STRATEGIES else (b, a)
    return f"use strategy={either(strategies_with(dimension))}"


def label(name: str, settings: Mapping[str, Any]) -> str:
    """How a refusal names a setting: ``strategy=fsdp``, ``sequence_parallel=2``, the mesh as
    ``tensor_parallel=T x pipeline_parallel=P``."""
    if name in STRATEGIES:
        return f"strategy={name}"
    if name in MESH_DIMENSIONS:
        return f"{TENSOR}={settings.get(TENSOR, 1)} x {PIPELINE}={settings.get(PIPELINE, 1)}"
    return f"{name}={settings.get(name, 1)}"


def active(settings: Mapping[str, Any]) -> List[str]:
    """The dimensions > 1 in ``settings`` (DIMENSIONS' order), then its strategy."""
    names = [d for d in DIMENSIONS if (settings.get(d) or 1) > 1]
    return names + ([settings["strategy"]] if settings.get("strategy") else [])


def refusals(settings: Mapping[str, Any], of: Optional[str] = None) -> List[Tuple[str, str]]:
    """Every refused pair among ``settings``' active dimensions and strategy, as (dimension, other) in
    RULES' order; only the pairs of dimension ``of`` when given (the mesh named once)."""
    on = set(active(settings))
    found: List[Tuple[str, str]] = []
    for (a, b), refused in RULES.items():
        if refused is None or a not in on or b not in on:
            continue
        if of is not None and of not in (a, b):
            continue
        first, other = (a, b) if of is None or a == of else (b, a)
        # Under a mesh of both T and P, one refusal for the mesh.
        if any(_same_mesh((first, other), seen) for seen in found):
            continue
        found.append((first, other))
    return found


def _same_mesh(pair: Tuple[str, str], seen: Tuple[str, str]) -> bool:
    named = lambda p: tuple("mesh" if n in MESH_DIMENSIONS else n for n in p)
    return named(pair) == named(seen)


def message(a: str, b: str, settings: Mapping[str, Any], prefix: str = "TrainConfig.") -> str:
    """``TrainConfig.<a> does not work with <b>: <reason>; <way out>``.

    Args:
        a: the first setting (a dimension).
        b: the second (a dimension or a strategy).
        settings: the settings' values, for the labels (``tensor_parallel=2 x pipeline_parallel=1``).
        prefix: what names the settings' owner.
    """
    return f"{prefix}{label(a, settings)} does not work with {label(b, settings)}: {reason(a, b)}; {way_out(a, b)}"


def check(settings: Mapping[str, Any], prefix: str = "TrainConfig.") -> Optional[str]:
    """The first refusal among ``settings`` (dimension sizes and ``strategy``), or None."""
    found = refusals(settings)
    return message(*found[0], settings, prefix) if found else None


# --- the docs' table ------------------------------------------------------------------------------

TABLE_BEGIN = "<!-- layout-rules: generated by hvdtrain.common.layout_rules.markdown_table(); do not edit -->"
TABLE_END = "<!-- /layout-rules -->"
_SHORT = {TENSOR: "T (tensor)", PIPELINE: "P (pipeline)", SEQUENCE: "S (sequence)", EXPERT: "E (experts)"}


def markdown_table() -> str:
    """Every pair, combined or refused with the reason and the way out (docs/concepts/model-parallelism.md)."""
    lines = [TABLE_BEGIN, "", "| with | combined? | why not | instead |", "|---|---|---|---|"]
    for (a, b), refused in RULES.items():
        pair = f"{_SHORT[a]} x {_SHORT.get(b, f'strategy={b}')}"
        if refused is None:
            lines.append(f"| {pair} | yes | | |")
        else:
            lines.append(f"| {pair} | **refused** | {reason(a, b)} | {way_out(a, b)} |")
    return "\n".join(lines + ["", TABLE_END])


def table_in(text: str) -> Optional[str]:
    """The generated table inside a page's text (begin to end markers), or None."""
    start = text.find(TABLE_BEGIN)
    end = text.find(TABLE_END)
    return None if start < 0 or end < start else text[start:end + len(TABLE_END)]


def pairs() -> FrozenSet[FrozenSet[str]]:
    """Every pair the table holds, unordered."""
    return frozenset(frozenset(key) for key in RULES)

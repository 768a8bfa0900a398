"""The layouts a family is checked under: how many ranks, and the Trainer settings that make them.

The sweep's five (T=2, P=2, T=2 x P=2, fsdp built on the meta device and S=2: sequence
parallelism) and ddp, by name; and any
(tensor, pipeline, sequence, experts, strategy, hsdp shard size) that ``hvdtrain check-layout`` is asked
for. Importing this module
imports no torch (the command line reads it while building its parser).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict

MICRO_BATCHES = 2  # a pipeline's: more than one, so the schedule interleaves stages


@dataclasses.dataclass(frozen=True)
class Layout:
    name: str
    tensor: int = 1
    pipeline: int = 1
    data: int = 1  # data-parallel replicas of the model
    strategy: str = "ddp"
    meta: bool = False  # the model built on the meta device, given its values by the Trainer
    sequence: int = 1  # ranks sharing each batch, each with part of every sequence
    experts: int = 1  # data-parallel ranks sharing every fused experts module, 1/E each
    shard: int = 0  # hsdp's ranks per shard group (0: the ranks of one host)

    @property
    def ranks(self) -> int:
        return self.tensor * self.pipeline * self.data * self.sequence

    def settings(self) -> Dict[str, Any]:
        """TrainConfig's fields for this layout."""
        return {"tensor_parallel": self.tensor, "pipeline_parallel": self.pipeline, "strategy": self.strategy,
                "micro_batches": MICRO_BATCHES if self.pipeline > 1 else 1, "sequence_parallel": self.sequence,
                "expert_parallel": self.experts, "hsdp_shard_size": self.shard}


LAYOUTS: Dict[str, Layout] = {layout.name: layout for layout in (
    Layout("T2", tensor=2),
    Layout("P2", pipeline=2),
    Layout("T2xP2", tensor=2, pipeline=2),
    Layout("fsdp-meta", data=2, strategy="fsdp", meta=True),
    Layout("ddp", data=2),
    Layout("S2", sequence=2),
    Layout("T2xS2", tensor=2, sequence=2),
)}
SWEEP = ("T2", "P2", "T2xP2", "fsdp-meta", "S2", "T2xS2")


def named(names: str) -> list:
    """Layouts from a comma-separated list of names, or ValueError naming the known ones."""
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in LAYOUTS]
    if unknown or not chosen:
        raise ValueError(f"unknown layout {', '.join(unknown) or '(none given)'}: choose from {', '.join(LAYOUTS)}")
    return [LAYOUTS[name] for name in chosen]


def layout_for(tensor: int, pipeline: int, strategy: str = "ddp", meta: bool = False, data: int = 0,
               sequence: int = 1, experts: int = 1, shard: int = 0) -> Layout:
    """The layout of ``hvdtrain check-layout``'s flags.

    Args:
        tensor: T, the tensor-parallel size.
        pipeline: P, the pipeline stages.
        strategy: the data-parallel strategy.
        meta: build the model on the meta device.
        data: data-parallel replicas; 0: one under a mesh or sequence groups, else two, or E (K) under expert
            parallelism (hsdp) when more (one rank alone would compare one process with itself).
        sequence: S, ranks per sequence group.
        experts: E, ranks per expert group (within the data replicas).
        shard: K, hsdp's ranks per shard group (0: the ranks of one host).
    """
    for flag, value in (("--tensor_parallel", tensor), ("--pipeline_parallel", pipeline), ("--data_parallel", data),
                        ("--sequence_parallel", sequence), ("--expert_parallel", experts),
                        ("--hsdp_shard_size", shard)):
        low = 0 if flag in ("--data_parallel", "--hsdp_shard_size") else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{flag} must be a whole number >= {low}, got {value!r}")
    data = data or (1 if tensor * pipeline * sequence > 1 else max(2, experts, shard))
    parts = [f"T{tensor}" if tensor > 1 else "", f"P{pipeline}" if pipeline > 1 else "",
             f"S{sequence}" if sequence > 1 else "", f"D{data}" if data > 1 else "",
             f"E{experts}" if experts > 1 else "", f"K{shard}" if shard else ""]
    name = "x".join(p for p in parts if p) + (f" {strategy}" if strategy != "ddp" else "") + (" meta" if meta else "")
    return Layout(name, tensor=tensor, pipeline=pipeline, data=data, strategy=strategy, meta=meta, sequence=sequence,
                  experts=experts, shard=shard)

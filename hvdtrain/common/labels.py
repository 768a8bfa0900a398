"""What a loss scores among a batch's labels: -100 is the label cross-entropy skips (torch's and
transformers' default ignore index: padding, prompts, a packed document's first token). The functions
take tensors and import nothing: the data's packing and the loss's token mean read them alike."""
from __future__ import annotations

from typing import Any

IGNORE_INDEX = -100


def causal_targets(labels: Any) -> Any:
    """The targets a causal LM's loss scores: each position's next label (``labels[..., 1:]``), the
    ignore index skipped (what transformers' causal LM loss and packed_lm_step average over); a
    tensor on the labels' device, so that counting makes no one wait for it."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


def causal_items(labels: Any) -> int:
    """causal_targets as a number (host labels: the Trainer counts a step's before it runs)."""
    return int(causal_targets(labels))


def label_items(labels: Any, ignore_index: int = IGNORE_INDEX) -> int:
    """The labels a loss scores where every label is its own target, the ignore index skipped."""
    return int((labels != ignore_index).sum())

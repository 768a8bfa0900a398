"""One case's verdict (a family under a layout and an optimizer) and the reason a refusal gives.

Four ends: ``equal`` (every gathered parameter and each step's loss within the tolerance of one
process), ``refused`` (hvdtrain raised a clear error at set-up or before the first step),
``differs`` (it trained, and is not one process's result: the bug this check exists for) and
``error`` (anything else: a crash inside the model, a hang, ranks that disagree). A family that
could not be built tiny is ``skipped``, with why. Imports no torch.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Optional, Tuple

RESULTS = ("equal", "refused", "differs", "error", "skipped")
TOLERANCE = 1e-10

# A refusal's message -> the reason it is counted under. The first that matches names it; the message
# itself is kept beside it. Worded loosely on purpose: the messages are hvdtrain's and may be rephrased.
REASONS: Tuple[Tuple[str, str], ...] = (
    # hvdtrain.parallel.sequence: its set-up probe, the attention interface, the heads' split.
    (r"sequence_parallel=\d+ would train another model.*mixes tokens", "sp: split loss or logits differ (set-up probe)"),
    (r"sequence_parallel=\d+ would train another model.*forward failed", "sp: split forward fails (set-up probe)"),
    (r"sequence_parallel.*AttentionInterface", "sp: attention outside transformers' interface"),
    (r"sequence_parallel.*num_attention_heads", "sp: no attention heads"),
    (r"sequence_parallel.*(query heads|key/value heads)", "sizes do not split"),
    # hvdtrain.parallel.tensor.audit and tensor_probe: a split found wrong before any update.
    (r"found on the first step", "tp: a gradient counted otherwise than once (first-step audit)"),
    (r"found at set-up\): on a probe", "tp: split logits differ from the whole model's (set-up probe)"),
    (r"found at set-up\): the split model's forward failed", "tp: split forward fails (set-up probe)"),
    (r"a forward of its own", "tp: a layer's own forward a split would drop"),
    (r"style '?[\w-]+'? is not supported|styles? .* not (supported|implemented)", "tp plan style not supported"),
    (r"matches no module", "tp plan names modules the model lacks"),
    (r"the plan and the split disagree", "tp: the family's plan cuts a fused weight apart"),
    (r"needs a tensor plan", "no tp plan"),
    (r"would cut a head|not divisible by|does not split into|divide", "sizes do not split"),
    (r"head-local", "attention not head-local"),
    (r"soft-?cap", "soft-capping outside the plan"),
    (r"scal(ed|es|ing) (the )?embedding|embedding scal|multiplier", "scaling outside the plan"),
    (r"lists? of identical blocks|names \d+ lists of decoder layers", "pipeline: no single list of decoder layers"),
    (r"given inputs_embeds, its forward still calls", "pipeline: position embeddings added to inputs_embeds"),
    (r"could not be followed", "pipeline: forward not followable with layers stood in for"),
    (r"between decoder layers", "pipeline: work between decoder layers"),
    (r"decoder layers take hidden states of shape", "pipeline: layers' hidden states not the embeddings' shape"),
    (r"cannot cut .* by itself|embed -> (decoder )?layers -> norm -> head", "pipeline: forward not embed -> layers -> norm -> head"),
    (r"sequence of layers|not a Hugging Face causal LM|leave out", "pipeline: no sequence of layers"),
    (r"pipeline", "pipeline: other"),
    (r"meta device|nothing initializes|unit by unit", "meta-device initialization"),
    (r"fsdp|shard", "sharding"),
)


def refusal_reason(message: str) -> str:
    for pattern, reason in REASONS:
        if re.search(pattern, message, flags=re.IGNORECASE):
            return reason
    return "other"


@dataclasses.dataclass
class Outcome:
    family: str
    layout: str
    optimizer: str
    result: str
    max_diff: Optional[float] = None  # over every gathered parameter
    loss_diff: Optional[float] = None  # over the per-step losses
    parameter: Optional[str] = None  # differs: the first parameter (in the model's order) past the tolerance
    parameter_diff: Optional[float] = None  # ... its max |diff|
    parameter_size: Optional[float] = None  # ... and its max |value| in one process's result
    moved: Optional[float] = None  # how far training moved the parameters (max |final - initial|)
    message: Optional[str] = None  # refused, error, skipped: the first line of what was raised
    reason: Optional[str] = None  # refused: refusal_reason(message); skipped: why
    seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.result not in RESULTS:
            raise ValueError(f"unknown result {self.result!r}: one of {', '.join(RESULTS)}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, line: str) -> "Outcome":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(line).items() if k in fields})

    def summary(self) -> str:
        """One line, as check-layout prints it."""
        if self.result == "equal":
            return f"equal (max |diff| = {self.max_diff:.1e}, per-step loss {self.loss_diff:.1e})"
        if self.result == "differs":
            where = (f"first at {self.parameter}: max |diff| {self.parameter_diff:.2e} (its values up to "
                     f"{self.parameter_size:.2e})" if self.parameter else f"per-step loss off by {self.loss_diff:.2e}")
            return f"differs: {where}; max |diff| over the model {self.max_diff:.2e}"
        if self.result == "refused":
            return f"refused ({self.reason}): {self.message}"
        return f"{self.result}: {self.message or self.reason}"


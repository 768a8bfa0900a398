"""The model the planner models: a GPT-style decoder's shape, its layers as hvdtrain's pipeline cuts
them, and the elements one rank of each stage holds under a tensor x pipeline split."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple

from hvdtrain.common.stage_split import contiguous_stages


@dataclass(frozen=True)
class LayerCost:
    """One pipeline layer: elements split over the tensor group, and elements every tensor rank keeps
    whole (``tied`` of them the token matrix, shared by the first and the last layer)."""

    split: float
    replicated: float
    tied: float = 0.0
    block: bool = False

    @property
    def elements(self) -> float:
        """What the pipeline weighs a layer by when it cuts stages: all its elements."""
        return self.split + self.replicated


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style decoder as hvdtrain.examples.textlm builds it: token and position embeddings,
    pre-norm blocks (qkv, proj, 4x MLP, biases, two LayerNorms), a final LayerNorm, the output layer
    tied to the token embedding. ``params``, when given, replaces the count this shape gives; the
    blocks take up the difference.

    A mixture-of-experts model also gives its routed experts: ``experts`` per MoE layer (0: a dense
    model), ``top_k`` of them per token, ``moe_layers`` layers with them, and ``expert_params``, the
    elements of every layer's routed experts together (part of ``params``; routers and shared experts
    are the rest, replicated as a dense model's).

    ``kv_heads``: key/value heads, fewer than ``heads`` under grouped-query attention (None: as many);
    a tensor split must divide them too."""

    layers: int
    d_model: int
    seq_len: int
    vocab: int
    heads: int
    params: Optional[float] = None
    experts: int = 0
    top_k: int = 0
    moe_layers: int = 0
    expert_params: float = 0.0
    kv_heads: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("layers", "d_model", "seq_len", "vocab", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {name} must be a whole number >= 1, got {value!r}")
        if self.d_model % self.heads:
            raise ValueError(f"d_model {self.d_model} must be a multiple of heads {self.heads}")
        if self.kv_heads is not None and (isinstance(self.kv_heads, bool) or not isinstance(self.kv_heads, int)
                                          or self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ValueError(f"key/value heads must be a whole number dividing the {self.heads} heads, got "
                             f"{self.kv_heads!r}")
        if self.params is not None and self.params <= self._outside_blocks():
            raise ValueError(f"--params {self.params:.4g} leaves nothing for the blocks: the embeddings and "
                             f"final norm of this shape already hold {self._outside_blocks():.4g}")
        if self.experts:
            self._check_experts()

    def _check_experts(self) -> None:
        if self.experts < 2 or not 1 <= self.top_k <= self.experts or not 1 <= self.moe_layers <= self.layers:
            raise ValueError(f"a mixture of experts needs experts >= 2 (got {self.experts}), a top-k between 1 and "
                             f"the experts (got {self.top_k}) and MoE layers between 1 and the {self.layers} layers "
                             f"(got {self.moe_layers})")
        blocks = self.total - self._outside_blocks()
        if not 0 < self.expert_params < blocks:
            raise ValueError(f"expert parameters {self.expert_params:.4g} must be > 0 and fewer than the blocks' "
                             f"{blocks:.4g} (give --params, the whole model's count, experts included)")

    @property
    def active_fraction(self) -> float:
        """Share of the parameters one token computes with: top-k of the routed experts, all the rest."""
        if not self.experts:
            return 1.0
        return 1 - self.expert_params / self.total * (1 - self.top_k / self.experts)

    def _outside_blocks(self) -> int:
        return (self.vocab + self.seq_len) * self.d_model + 2 * self.d_model

    @property
    def shape_params(self) -> int:
        """V d + S d + L (12 d^2 + 13 d) + 2 d: the exact count of TinyTransformerLM (head tied)."""
        d = self.d_model
        return self._outside_blocks() + self.layers * (12 * d * d + 13 * d)

    @property
    def total(self) -> float:
        return self.shape_params if self.params is None else self.params

    def pipeline_layers(self) -> Tuple[LayerCost, ...]:
        """[embedding, each block, head], as textlm_parallel.pipeline_layers cuts the model. A block's
        qkv (weight and bias), proj weight, MLP weights and first bias split; its norms and the
        row-parallel biases (proj, second MLP linear) stay whole."""
        d, v = self.d_model, self.vocab
        split, replicated = 12 * d * d + 7 * d, 6 * d
        scale = (self.total - self._outside_blocks()) / (self.layers * (split + replicated))
        block = LayerCost(split * scale, replicated * scale, block=True)
        return (LayerCost(0, (v + self.seq_len) * d, tied=v * d), *([block] * self.layers),
                LayerCost(0, 2 * d + v * d, tied=v * d))


@lru_cache(maxsize=None)
def stage_layers(shape: ModelShape, pipeline: int) -> Tuple[Tuple[int, ...], ...]:
    """The layer indices of every stage: hvdtrain's own split (balanced by parameter count)."""
    costs = [layer.elements for layer in shape.pipeline_layers()]
    return tuple(tuple(stage) for stage in contiguous_stages(costs, pipeline))


def stage_elements(shape: ModelShape, tensor: int, pipeline: int) -> List[float]:
    """The parameter elements one rank of each stage holds."""
    layers = shape.pipeline_layers()
    out = []
    for stage in stage_layers(shape, pipeline):
        held = [layers[i] for i in stage]
        both_ends = len(stage) and stage[0] == 0 and stage[-1] == len(layers) - 1
        tied_once = layers[0].tied if both_ends else 0.0  # one Parameter when a stage holds both ends
        out.append(sum(layer.split / tensor + layer.replicated for layer in held) - tied_once)
    return out

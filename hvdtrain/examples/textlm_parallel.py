"""How the example transformer (hvdtrain.examples.textlm.TinyTransformerLM) is split for model
parallelism: its tensor-parallel plan and its pipeline layers, written out."""
from __future__ import annotations


# --- Tensor parallelism (Megatron): the plan ---------------------------------------------------

def tensor_plan(model) -> dict:
    """TinyTransformerLM's Megatron plan, every layer named: each block's attention split by heads
    (qkv column-parallel in [q; k; v] groups, proj row-parallel) and its MLP's first linear
    column-parallel, its second row-parallel. The embeddings, LayerNorms and the tied head stay
    replicated in the tensor group."""
    from hvdtrain.examples.textlm import TinyTransformerLM

    if not isinstance(model, TinyTransformerLM):
        raise TypeError(f"tensor_plan is TinyTransformerLM's plan, got {type(model).__name__}: write one "
                        f"for it ({{module path: 'colwise' | 'rowwise' | 'attention'}})")
    plan = {}
    for index in range(len(model.blocks)):
        plan[f"blocks.{index}.attention"] = "attention"
        plan[f"blocks.{index}.mlp.0"] = "colwise"
        plan[f"blocks.{index}.mlp.2"] = "rowwise"
    return plan


def check_tensor_parallel(model, tensor: int) -> None:
    """ValueError saying what to change when TinyTransformerLM cannot run split over ``tensor``
    ranks by hand, outside the Trainer (heads or widths not divisible, dropout on: the Trainer gives
    a tensor group one random stream, a hand-made split does not). Changes nothing, no collective."""
    from torch import nn

    from hvdtrain.parallel.tensor.plan import check_plan

    check_plan(model, tensor_plan(model), tensor)
    if tensor > 1:
        dropping = [name for name, m in model.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        dropping += [f"{name}.dropout" for name, m in model.named_modules()
                     if hasattr(m, "heads") and getattr(m, "dropout", 0) > 0]
        if dropping:
            raise ValueError(f"tensor_parallel={tensor} needs model.dropout=0 outside the Trainer: each rank "
                             f"draws its own dropout masks, so replicated activations would differ across "
                             f"the tensor group ({dropping[0]} has dropout > 0); the Trainer seeds a tensor "
                             f"group's ranks alike")


def parallelize_tensor(model, group):
    """Check, then split TinyTransformerLM over the tensor ``group`` (a mesh Group) in place."""
    from hvdtrain.parallel.tensor.plan import parallelize

    check_tensor_parallel(model, 1 if group is None else group.size)
    return parallelize(model, tensor_plan(model), group)


# --- Pipeline parallelism: the layers, in order -------------------------------------------------

import torch  # noqa: E402  (the pipeline's layer modules below are nn.Modules)
from torch import nn  # noqa: E402


class TextLMEmbedding(nn.Module):
    """The first pipeline layer: ids -> dropout(token(ids) + position(0..T-1)), on the model's own
    embedding and dropout modules (not copies: the token matrix is the tied output layer too)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.seq_len = model.seq_len
        self.token, self.position, self.dropout = model.token, model.position, model.dropout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        length = ids.shape[1]
        if length > self.seq_len:
            raise ValueError(f"{length} tokens exceed the model's context of {self.seq_len}")
        positions = torch.arange(length, device=ids.device)
        return self.dropout(self.token(ids) + self.position(positions))


class TextLMHead(nn.Module):
    """The last pipeline layer: the final LayerNorm and the output layer (the model's own; its
    weight is the token embedding's)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.norm, self.head = model.norm, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))


def pipeline_layers(model) -> list:
    """TinyTransformerLM as a list of layers for hvdtrain.parallel.pipeline.schedule: [embedding, each
    block, head]. They share the model's modules, so the tied token matrix is one Parameter in the
    first and the last layer (PipelineStage sums its gradient over the two stages holding it)."""
    from hvdtrain.examples.textlm import TinyTransformerLM

    if not isinstance(model, TinyTransformerLM):
        raise TypeError(f"pipeline_layers is TinyTransformerLM's split, got {type(model).__name__}: give "
                        f"PipelineStage your model's own list of layers")
    return [TextLMEmbedding(model), *model.blocks, TextLMHead(model)]

"""A tensor plan: which layers of a model split over the tensor group, and how.

A plan maps module paths (or fnmatch patterns: ``layers.*.self_attn.q_proj``) to styles. The styles
are those of Hugging Face's plans (``model.tp_plan``, ``config.base_model_tp_plan``), so a Llama,
Qwen2/Qwen3 or Mistral splits by its own plan, plus hvdtrain's ``attention`` for its example
transformer:

- ``colwise``: an nn.Linear split by output features; its output stays split (q/k/v by heads, an
  MLP's up projections).
- ``rowwise``: an nn.Linear split by input features, the output summed over the group (o_proj,
  down_proj).
- ``colwise_gather_output``: colwise, then the output gathered whole on every rank (an LM head).
- ``rowwise_split_input``: rowwise over an input every rank holds whole (after a gathered output).
- ``packed_colwise``: colwise over two fused projections ([gate; up] in one weight), each cut alike.
- ``embedding_rowwise``: an nn.Embedding split by vocabulary rows, the lookups summed.
- ``replicated_with_grad_allreduce``: kept whole, its gradients summed over the group (a per-head
  norm that sees only this rank's heads).
- ``attention``: hvdtrain's own self-attention (qkv and proj) split by heads.
- ``moe_tp_experts``: fused 3-D experts (Qwen2-MoE, Qwen3-MoE, Mixtral), each expert's intermediate
  dimension cut, with the entries naming their parameters (hvdtrain.parallel.tensor.experts).
- ``local_params``: a module running on its own split bare parameters (attention sinks), each cut
  by its own entry (hvdtrain.parallel.tensor.local).
- ``mla_kv_a_proj``: multi-head latent attention's whole [latent; rotary key] projection, the rotary
  key's gradient summed over the group (hvdtrain.parallel.tensor.mla).
- ``packed_rowwise``: a transposed experts layout's [gate | up] input projection (experts, hidden,
  2 x intermediate), cut along its last dim in 2 groups; an entry of moe_tp_experts' parameters only.
- ``moe_identity_expert``: an identity expert inside moe_tp_experts, its input divided by the group
  size so that the experts' sum counts it once (hvdtrain.parallel.tensor.experts).
- ``all_reduce``: a module running on its own bare parameters cut by their entries, its partial
  output summed over the group (hvdtrain.parallel.tensor.partial).

transformers 4.x plans name two of them otherwise, taken as aliases: ``colwise_rep`` is
``colwise_gather_output`` and ``rowwise_rep`` is ``rowwise_split_input`` (transformers registers each
pair as the same layer: ColwiseParallel, RowwiseParallel with a replicated input and output).

Checking a plan changes nothing and talks to no other rank: every rank holds the same model, so
every rank decides alike.
"""
from __future__ import annotations

import fnmatch
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch
from torch import nn

from hvdtrain.common.errors import LayoutError
from hvdtrain.parallel.own_forward import has_own_forward, own_forward_problem
from hvdtrain.parallel.tensor.experts import (EXPERT_STYLES, IDENTITY_STYLES, check_experts, check_identity_expert,
                                              check_parameter_entries, divided_identity, is_transposed, named_cuts,
                                              parameter_paths, split_experts, why_not)
from hvdtrain.parallel.tensor.local import (LOCAL_STYLES, check_local_parameter, owned_parameters,
                                            split_local_parameters)
from hvdtrain.parallel.tensor.mla import MLA_STYLES, check_mla, sum_rotary_key_gradient
from hvdtrain.parallel.tensor.partial import (PARTIAL_STYLES, check_partial_module, owned_cuts,
                                              partial_parameter_entries, split_partial_module)
from hvdtrain.parallel.tensor.layers import (ColumnParallelLinear, GatheredColumnParallelLinear, ParallelSelfAttention,
                                      RowParallelLinear, SplitInputRowParallelLinear, VocabParallelEmbedding,
                                      sum_gradients_over_group)

COLUMN_STYLES = ("colwise", "colwise_gather_output", "packed_colwise")
ROW_STYLES = ("rowwise", "rowwise_split_input")
# Styles that name a parameter only (a fused experts' 3-D weight), never a module.
PARAMETER_ONLY_STYLES = ("packed_rowwise",)
STYLES = (COLUMN_STYLES + ROW_STYLES + ("embedding_rowwise", "replicated_with_grad_allreduce", "attention") + EXPERT_STYLES
          + MLA_STYLES + LOCAL_STYLES + PARAMETER_ONLY_STYLES + IDENTITY_STYLES + PARTIAL_STYLES)
# transformers' "replicate": every rank keeps the whole module (its TensorParallelLayer does nothing).
WHOLE_STYLES = ("replicate",)
ALIASES = {"column": "colwise", "row": "rowwise",
           "colwise_rep": "colwise_gather_output", "rowwise_rep": "rowwise_split_input"}
# Styles whose layers get new, split parameters (the last two above keep theirs whole).
SPLITTING = COLUMN_STYLES + ROW_STYLES + ("embedding_rowwise", "attention") + EXPERT_STYLES + PARTIAL_STYLES
_SPLIT_LAYERS = (ColumnParallelLinear, RowParallelLinear, ParallelSelfAttention, VocabParallelEmbedding)


def model_tensor_plan(model: nn.Module) -> Optional[Dict[str, str]]:
    """A Hugging Face model's own plan (transformers puts its base model's plan, prefixed, and its
    head's into ``model.tp_plan``), or None for a model without one."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
    return dict(plan) if isinstance(plan, Mapping) and plan else None


def _matches(modules: Mapping[str, nn.Module], key: str) -> List[str]:
    return [path for path in modules if path and (path == key or fnmatch.fnmatchcase(path, key))]


def _match_key(model: nn.Module, modules: Mapping[str, nn.Module], key: str) -> List[str]:
    """The module paths ``key`` names; a key of the base model's plan (``config.base_model_tp_plan``:
    ``layers.*.mlp.up_proj``) also under the base model's prefix (``model.layers.*...``)."""
    matched = _matches(modules, key)
    prefix = getattr(model, "base_model_prefix", None)
    if not matched and isinstance(prefix, str) and prefix and prefix in modules:
        matched = _matches(modules, f"{prefix}.{key}")
    return matched


def _heads_check(path: str, module: nn.Module, parent: Optional[nn.Module], style: str, size: int) -> None:
    """A projection of an attention that views its output as heads of ``head_dim`` (Hugging Face's)
    must not cut a head: q_proj's heads, and with grouped-query attention k_proj's and v_proj's
    fewer key/value heads, must divide by the group size."""
    head_dim = getattr(parent, "head_dim", None)
    if not isinstance(head_dim, int) or head_dim <= 0:
        return
    width = module.in_features if style in ROW_STYLES else module.out_features
    if width % head_dim:
        return  # not a projection into heads (an MLP inside an attention-like module)
    heads = width // head_dim
    if heads % size:
        raise LayoutError(f"tensor plan: {path} holds {heads} heads of {head_dim} ({type(parent).__name__}); "
                         f"tensor_parallel={size} would cut a head. Choose a tensor_parallel that divides "
                         f"{heads} (grouped-query attention has fewer key/value heads than query heads)")


def _check_module(path: str, module: nn.Module, parent: Optional[nn.Module], style: str, size: int) -> None:
    """ValueError naming ``path`` when ``style`` cannot split ``module`` over ``size`` ranks."""
    if isinstance(module, _SPLIT_LAYERS):
        raise ValueError(f"tensor plan: {path} is an already split {type(module).__name__}: parallelize once")
    if style in COLUMN_STYLES + ROW_STYLES:
        if not isinstance(module, nn.Linear):
            raise ValueError(f"tensor plan: {path} is {type(module).__name__}, but style {style!r} splits an nn.Linear")
        if has_own_forward(module, nn.Linear):
            raise ValueError(f"tensor plan: {path} is a {type(module).__name__}, an nn.Linear with a forward of its "
                             f"own, which a split layer would not run (it computes nn.Linear's on its slice): the "
                             f"split would train another model. Leave {path} out of the plan "
                             f"(ModelPlan(tensor_plan=...) without it)")
        width, what = (module.in_features, "in_features") if style in ROW_STYLES else (module.out_features, "out_features")
        parts = 2 * size if style == "packed_colwise" else size
        if width % parts:
            packed = " x 2 packed projections" if style == "packed_colwise" else ""
            raise ValueError(f"tensor plan: {path} ({style}) has {what}={width}, not divisible by "
                             f"tensor_parallel={size}{packed}")
        _heads_check(path, module, parent, style, size)
        return
    if style == "embedding_rowwise":
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"tensor plan: {path} is {type(module).__name__}, but style 'embedding_rowwise' "
                             f"splits an nn.Embedding")
        if module.num_embeddings % size:
            raise ValueError(f"tensor plan: {path} has {module.num_embeddings} rows, not divisible by "
                             f"tensor_parallel={size}: pad the vocabulary to a multiple of it")
        problem = own_forward_problem(module, nn.Embedding) if has_own_forward(module, nn.Embedding) else None
        if problem is not None:
            raise ValueError(f"tensor plan: {path} is a {type(module).__name__}, an nn.Embedding with a forward of its "
                             f"own that a split table cannot keep ({problem}): the split would train another model. "
                             f"Leave {path} out of the plan (and a head tied to it)")
        if module.max_norm is not None or module.sparse:
            raise ValueError(f"tensor plan: {path} uses max_norm or sparse gradients, which a split table "
                             f"cannot reproduce; keep it whole (leave it out of the plan)")
        return
    if style == "replicated_with_grad_allreduce":
        return
    if style in EXPERT_STYLES:
        return check_experts(path, module, size)
    linear = lambda attr: isinstance(getattr(module, attr, None), nn.Linear)
    heads = getattr(module, "heads", None)
    if not (linear("qkv") and linear("proj") and isinstance(heads, int) and hasattr(module, "dropout")
            and hasattr(module, "residual_dropout")):
        raise ValueError(f"tensor plan: {path} is {type(module).__name__}, but style 'attention' splits a "
                         f"self-attention with nn.Linear qkv and proj, an int heads, dropout and residual_dropout")
    if module.qkv.out_features != 3 * module.proj.in_features:
        raise ValueError(f"tensor plan: {path}.qkv has {module.qkv.out_features} outputs, not 3 x "
                         f"{module.proj.in_features} (q, k and v of proj's width)")
    if heads % size:
        raise LayoutError(f"tensor plan: {path} has heads={heads}, not divisible by tensor_parallel={size}")


def summed_parameters(model: nn.Module, chosen: List[Tuple[str, str]]) -> List[str]:
    """The names of the parameters whose gradients the plan sums over the tensor group."""
    return [f"{path}.{name}" for path, style in chosen if style == "replicated_with_grad_allreduce"
            for name, p in model.get_submodule(path).named_parameters() if p.requires_grad]


def _vocabulary_rows(style: str) -> bool:
    """Whether ``style`` cuts its weight into the group's parts along dim 0, one block per rank (an
    embedding's rows and a head's output rows: a tied embedding and head may share that cut)."""
    return style in ("embedding_rowwise", "colwise", "colwise_gather_output")


def _check_ties(model: nn.Module, chosen: Mapping[str, str]) -> None:
    """A parameter registered in several modules (a tied embedding and head) is split only where
    every one of them splits it alike; otherwise the tie would silently come apart."""
    owners: Dict[int, List[Tuple[str, str]]] = {}
    for path, module in model.named_modules(remove_duplicate=False):
        for name, parameter in module.named_parameters(recurse=False):
            owners.setdefault(id(parameter), []).append((path, name))
    for path, style in chosen.items():
        if style not in SPLITTING:
            continue
        module = model.get_submodule(path)
        for name, parameter in module.named_parameters():
            inside = [(p, n) for p, n in owners[id(parameter)] if p == path or p.startswith(path + ".")]
            for other, other_name in owners[id(parameter)]:
                if (other, other_name) in inside:
                    continue
                other_style = chosen.get(other)
                if not (name == "weight" and other_name == "weight" and other_style is not None
                        and _vocabulary_rows(style) and _vocabulary_rows(other_style)):
                    how = f"splits it as {other_style!r}" if other_style else "keeps it whole"
                    raise ValueError(
                        f"tensor plan: {path}.{name} is tied to {other}.{other_name}, and the plan {how}: a tie "
                        f"must be cut alike on both sides or not at all. Split both by vocabulary rows "
                        f"('embedding_rowwise' for the embedding, 'colwise_gather_output' for the head) or "
                        f"leave both out of the plan")


def check_plan(model: nn.Module, plan: Mapping[str, str], size: int) -> List[Tuple[str, str]]:
    """The (module path, style) pairs ``plan`` applies to ``model`` split over ``size`` ranks, in the
    model's module order; ValueError naming the layer or the plan key when it cannot."""
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor plan: tensor_parallel must be a whole number >= 1, got {size!r}")
    modules = dict(model.named_modules())
    chosen: Dict[str, str] = {}
    by_parameter: Dict[str, str] = {}  # entries naming parameters (fused experts'): checked with their modules
    own_plan = model_tensor_plan(model) or {}
    for key, style in plan.items():
        if style in WHOLE_STYLES:
            continue  # kept whole, as a module the plan does not name (its gradients audited alike)
        matched = _match_key(model, modules, key)
        parameters = [] if matched else parameter_paths(model, key)
        if not matched and own_plan.get(key) == style and not parameters:
            # The family's plan names layers this configuration lacks (Qwen2-MoE's dense MLPs, Qwen4-Exp's
            # per-layer embeddings when no layer has them): nothing is cut, whatever the style.
            continue
        canonical = ALIASES.get(style, style)
        if canonical not in STYLES:
            raise ValueError(f"tensor plan: {key}: style {style!r} is not supported; hvdtrain splits by "
                             f"{', '.join(STYLES + tuple(ALIASES))}{why_not(style)}: give a plan without it")
        if not matched and parameters:
            by_parameter[key] = canonical
            continue
        if matched and canonical in PARAMETER_ONLY_STYLES:
            raise ValueError(f"tensor plan: {key!r} ({style}) names the module {matched[0]}: hvdtrain cuts "
                             f"{style!r} only as a fused experts' parameter (experts, hidden, 2 x intermediate) "
                             f"inside moe_tp_experts")
        if not matched:
            some = ", ".join(p for p in list(modules)[1:9])
            raise ValueError(f"tensor plan: {key!r} matches no module of {type(model).__name__} "
                             f"(its modules include {some}, ...)")
        for path in matched:
            if chosen.setdefault(path, canonical) != canonical:
                raise ValueError(f"tensor plan: {path} is given two styles, {chosen[path]!r} and {canonical!r}")
    cuts = named_cuts(model, by_parameter)
    for path, style in chosen.items():
        nested = [other for other in chosen if other.startswith(path + ".")]
        # local_params keeps its module: its layers split by their own; split experts hold their identity expert
        allowed = style in LOCAL_STYLES or (style in EXPERT_STYLES and all(chosen[n] in IDENTITY_STYLES for n in nested))
        if nested and not allowed:
            raise ValueError(f"tensor plan: {path} ({style}) contains {nested[0]} ({chosen[nested[0]]}): "
                             f"give one of them")
        parent_path = path.rpartition(".")[0]
        parent = modules.get(parent_path) if parent_path else model
        if style in MLA_STYLES:
            check_mla(path, modules[path], model, parent)
        elif style in LOCAL_STYLES:
            pass  # its bare parameters' entries are checked below; the module itself stays
        elif style in EXPERT_STYLES:
            check_experts(path, modules[path], size, is_transposed(path, modules[path], cuts))
        elif style in IDENTITY_STYLES:
            check_identity_expert(path, modules[path], parent_path, chosen.get(parent_path))
        elif style in PARTIAL_STYLES:
            check_partial_module(path, modules[path], owned_cuts(path, cuts), size)
        else:
            _check_module(path, modules[path], parent, style, size)
    local = _local_parameter_entries(model, by_parameter, chosen)
    for parameter, (key, style) in local.items():
        check_local_parameter(key, parameter, model.get_parameter(parameter), style, size)
    partial = set(partial_parameter_entries(cuts, chosen))
    owned_elsewhere = {e for e, _ in local.values()} | {key for key in by_parameter
                                                       if set(parameter_paths(model, key)) <= partial}
    check_parameter_entries(model, {k: s for k, s in by_parameter.items() if k not in owned_elsewhere}, chosen)
    _check_ties(model, chosen)
    return [(path, chosen[path]) for path in modules if path in chosen]


def _local_parameter_entries(model: nn.Module, by_parameter: Mapping[str, str],
                             chosen: Mapping[str, str]) -> Dict[str, Tuple[str, str]]:
    """The parameters named by ``by_parameter`` (key -> style) whose module is given local_params:
    parameter path -> (key, style)."""
    return {parameter: (key, style) for key, style in by_parameter.items()
            for parameter in parameter_paths(model, key) if chosen.get(parameter.rpartition(".")[0]) in LOCAL_STYLES}


def _split(module: nn.Module, style: str, group: Any, path: str, cuts: Mapping[str, str],
           observe: Optional[Callable[[str, torch.Tensor], None]]) -> Optional[nn.Module]:
    """The split layer replacing ``module``, or None where the module stays (its gradients summed);
    ``cuts``: the plan's styles of parameters it names (parameter path -> style)."""
    if style == "colwise":
        return ColumnParallelLinear.from_linear(module, group, name=path)
    if style == "packed_colwise":
        return ColumnParallelLinear.from_linear(module, group, groups=2, name=path)
    if style == "colwise_gather_output":
        return GatheredColumnParallelLinear.from_linear(module, group, name=path)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, group, name=path)
    if style == "rowwise_split_input":
        return SplitInputRowParallelLinear.from_linear(module, group, name=path)
    if style == "embedding_rowwise":
        return VocabParallelEmbedding.from_embedding(module, group, name=path)
    if style == "attention":
        return ParallelSelfAttention.from_attention(module, group, name=path)
    if style in EXPERT_STYLES:
        return split_experts(module, group, path, is_transposed(path, module, cuts))
    if style in PARTIAL_STYLES:
        return split_partial_module(module, owned_cuts(path, cuts), group, path)
    if style in IDENTITY_STYLES:
        return divided_identity(module, group)
    sum_gradients_over_group(module, group, path, observe)
    return None


Replacement = Tuple[nn.Module, str, nn.Module, nn.Module]  # (parent, attribute, the layer as built, its split)


def parallelize(model: nn.Module, plan: Mapping[str, str], group: Any,
                replacements: Optional[List[Replacement]] = None,
                observe: Optional[Callable[[str, torch.Tensor], None]] = None) -> nn.Module:
    """Split the model's layers in place over the tensor group as the plan says.
    Every layer is checked first (ValueError naming it; the model is then unchanged). Returns
    ``model``. Its collectives are named after the layers' paths, so every rank of the group
    matches them. A tied weight split alike on both sides stays one parameter.

    Args:
        model: the whole model.
        plan: layer path (or pattern) -> style.
        group: the tensor group (a mesh Group).
        replacements: each layer replaced is appended to it (a model built on the meta device is initialized as built).
        observe: ``observe(name, part)`` sees each summed parameter's gradient part before its sum.
    """
    size = 1 if group is None else group.size
    if group is None:
        group = _Alone()
    split_weights: Dict[int, nn.Parameter] = {}  # id(the whole weight) -> its split replacement
    chosen = check_plan(model, plan, size)
    entries = {key: ALIASES.get(style, style) for key, style in plan.items() if parameter_paths(model, key)}
    local = _local_parameter_entries(model, entries, dict(chosen))
    named = named_cuts(model, entries)
    for path, style in chosen:
        module = model.get_submodule(path)
        if style in LOCAL_STYLES:
            split_local_parameters(module, owned_parameters(path, local), group)
            continue
        if style in MLA_STYLES:
            parent_path = path.rpartition(".")[0]
            sum_rotary_key_gradient(module, model, model.get_submodule(parent_path) if parent_path else model,
                                    group, path)
            continue
        whole = getattr(module, "weight", None)
        new = _split(module, style, group, path, named, observe)
        if new is None:
            continue
        if whole is not None and id(whole) in split_weights:
            new.weight = split_weights[id(whole)]  # the other side of a tie, cut alike (checked)
        elif whole is not None:
            split_weights[id(whole)] = new.weight
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, new)
        if replacements is not None:
            replacements.append((parent, child, module, new))
    return model


class _Alone:
    """A tensor group of one rank (no parallelism): nothing to communicate."""

    ranks, index, size, process_set = (0,), 0, 1, None

    def __repr__(self) -> str:
        return "Group(alone)"

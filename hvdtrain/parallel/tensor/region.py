"""Whole parameters inside a split region: their gradients are summed over the tensor group.

Between a column-parallel layer and the row-parallel one that sums its output, every rank holds only
its part of an activation (its heads, its columns of an MLP's hidden width). A parameter kept whole
that meets such an activation in an operation (xIELU's learnable alpha_p and alpha_n scaling the
output of Apertus' colwise up_proj; a per-head q_norm behind a colwise q_proj that the plan does not
name) gets from each rank's backward only that rank's part of its gradient: the one process's
gradient is their sum. Kept whole and summed over the group, it trains as in one process. Where the
part is the whole (the same on every rank), summing would count it T times; the first-step audit
(tensor_audit) refuses that, so a wrong call here is refused, not trained.

Which parameters: decided at set-up, while every rank holds the whole model with the same values,
from the autograd graph of one forward on the probe's token ids (tensor_probe). An activation is split
from the output of a ``colwise``/``packed_colwise`` layer of the plan on, through every operation
that takes a split input, until a layer whose output is whole again (a row-parallel one, a gathered
head, ...). A parameter outside the plan's layers is in the region when a value derived from it alone
(softplus(alpha_p), a weight cast to another dtype) enters an operation with a split input before it
reaches the output of a layer of the plan. A value that reaches such a layer whole is not: the split
layer makes its gradient whole already (a column-parallel layer, hvdtrain's attention and fused
experts sum their input's gradient, Megatron's f; a split-input row-parallel layer gathers it; MLA's
shared projection sums its rotary key's), and a row-parallel layer's input is split, so a value got
there only through an operation with a split input, which decided it first.
A model built on the meta device has no values to run at set-up: nothing is decided, and the audit
refuses what it would have summed.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hvdtrain.parallel.tensor.probe import probe_ids

# Styles whose layer's output holds only this rank's part (its output columns).
SPLIT_OUTPUT_STYLES = ("colwise", "packed_colwise")
# Styles whose layer's output is whole on every rank: summed (row-parallel, a split table, fused
# experts, hvdtrain's attention), gathered (an LM head), or never split (MLA's shared projection).
WHOLE_OUTPUT_STYLES = ("rowwise", "rowwise_split_input", "colwise_gather_output", "embedding_rowwise", "attention",
                       "moe_tp_experts", "mla_kv_a_proj")


def _grad_fns(output: Any) -> List[Any]:
    return [leaf.grad_fn for leaf in tree_leaves(output) if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]


def _outputs_of_plan_layers(model: nn.Module, chosen: Sequence[Tuple[str, str]], ids: torch.Tensor
                            ) -> Tuple[List[Any], Set[int], Set[int], List[Any]]:
    """One forward of the whole model (eval mode: no dropout, no random draw; gradients recorded):
    the graph's roots, the ids of the nodes producing split outputs and of those producing whole
    outputs of the plan's layers, and every such node (kept alive while their ids are compared)."""
    split: Set[int] = set()
    whole: Set[int] = set()
    kept: List[Any] = []

    def recorder(into: Set[int]) -> Callable[..., None]:
        def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
            for node in _grad_fns(output):
                into.add(id(node))
                kept.append(node)
        return hook

    handles = []
    for path, style in chosen:
        into = split if style in SPLIT_OUTPUT_STYLES else whole if style in WHOLE_OUTPUT_STYLES else None
        if into is not None:
            handles.append(model.get_submodule(path).register_forward_hook(recorder(into)))
    training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            output = model(input_ids=ids, use_cache=False)
    finally:
        model.train(training)
        for handle in handles:
            handle.remove()
    return _grad_fns(output), split, whole, kept


class _Graph:
    """The backward graph reachable from ``roots``: each node's inputs (the nodes producing them),
    each node's consumers, and each leaf's AccumulateGrad node by the leaf's id."""

    def __init__(self, roots: Iterable[Any]) -> None:
        self.nodes: Dict[int, Any] = {}
        self.inputs: Dict[int, List[int]] = {}
        self.consumers: Dict[int, List[int]] = {}
        self.accumulator: Dict[int, int] = {}  # id(parameter) -> id(its AccumulateGrad node)
        stack = list(roots)
        for root in stack:
            self.nodes[id(root)] = root
        while stack:
            node = stack.pop()
            producers = [next_node for next_node, _ in node.next_functions if next_node is not None]
            self.inputs[id(node)] = [id(p) for p in producers]
            variable = getattr(node, "variable", None)
            if isinstance(variable, torch.Tensor):
                self.accumulator[id(variable)] = id(node)
            for producer in producers:
                self.consumers.setdefault(id(producer), []).append(id(node))
                if id(producer) not in self.nodes:
                    self.nodes[id(producer)] = producer
                    stack.append(producer)

    def split_outputs(self, sources: Set[int], whole: Set[int]) -> Set[int]:
        """The nodes whose output holds only this rank's part once split: a source's, and any node's
        with a split input, unless its output is made whole (``whole``)."""
        split: Set[int] = set()
        done: Set[int] = set()
        for start in self.nodes:
            stack = [(start, False)]
            while stack:  # post-order without recursion (a deep model's graph is deep)
                node, inputs_done = stack.pop()
                if node in done:
                    continue
                if not inputs_done:
                    stack.append((node, True))
                    stack.extend((i, False) for i in self.inputs.get(node, ()) if i not in done)
                    continue
                done.add(node)
                if node in sources or (node not in whole and any(i in split for i in self.inputs.get(node, ()))):
                    split.add(node)
        return split

    def meets_split(self, parameter: nn.Parameter, split: Set[int], layers: Set[int]) -> bool:
        """Whether a value derived from ``parameter`` alone enters an operation with a split input
        before it reaches the output of one of the plan's layers (``layers``)."""
        start = self.accumulator.get(id(parameter))
        if start is None:
            return False  # not used by this forward: nothing to decide from
        seen, stack = {start}, [start]
        while stack:
            for consumer in self.consumers.get(stack.pop(), ()):
                if consumer in seen:
                    continue
                seen.add(consumer)
                if any(i in split for i in self.inputs.get(consumer, ())):
                    return True
                if consumer not in layers:
                    stack.append(consumer)
        return False


def _outside_the_plan(model: nn.Module, chosen: Sequence[Tuple[str, str]]) -> List[Tuple[str, nn.Parameter]]:
    """The trainable parameters of modules the plan neither splits nor sums (nor contains)."""
    paths = [path for path, _ in chosen]
    inside = lambda name: any(name.startswith(path + ".") for path in paths)  # noqa: E731
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad and not inside(name)]


def split_region_parameters(model: nn.Module, chosen: Sequence[Tuple[str, str]],
                            device: torch.device) -> Optional[List[str]]:
    """The names of ``model``'s whole parameters (outside the plan's layers ``chosen``: (path, style)
    pairs) that meet a split activation, from one forward of the whole model on a few token ids; None
    when it cannot be run (a model on the meta device, one that takes no input_ids)."""
    ids = probe_ids(model, device)
    if ids is None or any(p.is_meta or p.untyped_storage().nbytes() == 0 for p in model.parameters() if p.numel()):
        return None
    try:
        roots, sources, whole, kept = _outputs_of_plan_layers(model, chosen, ids)
    except Exception:  # noqa: BLE001  (a model that cannot run on input_ids alone: nothing decided)
        return None
    graph = _Graph(roots)
    split = graph.split_outputs(sources, whole)
    names = [name for name, p in _outside_the_plan(model, chosen) if graph.meets_split(p, split, sources | whole)]
    del kept, roots  # the graph (and its saved activations) goes with them
    return names


def agreed_names(mine: Optional[Sequence[str]], everyone: Callable[[List[str]], List[List[str]]]) -> List[str]:
    """Every rank's names together (``everyone``: an all-gather), in the model's order of the first
    rank that has them: every rank then sums the same gradients (a sum on some ranks alone would hang)."""
    union: List[str] = []
    for names in everyone(list(mine or [])):
        union.extend(name for name in names if name not in union)
    return union


def sum_split_region_gradients(model: nn.Module, names: Sequence[str], group: Any,
                               observe: Optional[Callable[[str, torch.Tensor], None]] = None) -> None:
    """Sum the gradients of some of the model's parameters over the tensor group (each rank computes only
    its part of them).

    Args:
        model: the model.
        names: the parameters' names.
        group: the tensor group.
        observe: ``observe(name, part)`` sees each part first.
    """
    from hvdtrain.parallel.tensor.layers import sum_parameter_gradients

    parameters: Mapping[str, nn.Parameter] = dict(model.named_parameters())
    sum_parameter_gradients([(name, parameters[name]) for name in names], group, observe)

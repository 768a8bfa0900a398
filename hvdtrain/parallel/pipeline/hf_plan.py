"""Where a Hugging Face causal LM can be cut into pipeline stages, read from the model itself.

transformers describes each family's pipeline in ``base_model_pp_plan`` (on the config class; the
causal LM's ``_pp_plan`` holds it with full paths and adds the head): one entry is the list of
decoder layers. Everything the model's forward does before the first layer (the embedding and
whatever the family does to it: Gemma's scaled embeddings, Granite's multiplier, dropout) is the
first pipeline layer, and everything after the last (the final norm, the head, Granite's logits
scaling, Gemma2's soft-capping) the last: both run the model's own code (hf_layers), so they
compute exactly what one process does.

That holds only for a forward of that shape, so it is verified once, on the whole model before it
is split, its tensors swapped for meta ones (nothing computed; no decoder layer runs): the
forward is run with the layers stood in for, and forward pre-hooks tell which modules with parameters it calls before the first
layer and after the last. Refused by name, before the first step: a family with no
``base_model_pp_plan``; work between decoder layers (layer i + 1's input is not what layer i
returned); a module with parameters called between layers, on both sides of them, or not at all;
a module with parameters called before the first layer even when the forward is given
``inputs_embeds`` (the last stage runs the forward that way, and does not hold it).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch import nn

_PROBE_TOKENS = 2


@dataclass(frozen=True)
class HFPipelinePlan:
    """Paths in the causal LM: the base model, its decoder layer list, and the modules with
    parameters its forward calls before the first layer (``entry``) and after the last (``exit``)."""

    family: str
    base: str
    layers: str
    entry: Tuple[str, ...]
    exit: Tuple[str, ...]


class _Stop(Exception):
    """Raised by a stand-in to end the model's forward where the pipeline needs no more of it."""


def _refusal(family: str, reason: str) -> ValueError:
    return ValueError(f"train.pipeline_parallel cannot cut a {family!r} model by itself: {reason}; give "
                      f"Trainer(..., model_plan=ModelPlan(pipeline_layers=fn)) with its layers in order")


def is_hf_causal_lm(model: nn.Module) -> bool:
    """A transformers model with a base model inside it (a causal LM's shape), whatever its family."""
    base = getattr(model, "base_model", None)
    return hasattr(model, "config") and hasattr(model, "base_model_prefix") and isinstance(base, nn.Module) \
        and base is not model


def layer_list_path(model: nn.Module) -> str:
    """The path of the decoder layer list: the one list the model's own ``_pp_plan`` names, else
    (a family transformers gives no base_model_pp_plan: GPT-2, OPT, OLMoE...) the one list of
    decoder blocks found in the model (layer_lists). Either is only a candidate: hf_pipeline_plan's
    probe verifies the forward runs it in order with nothing between. ValueError naming the
    family when there is no such list or more than one."""
    family = getattr(model.config, "model_type", type(model).__name__)
    plan = getattr(model, "_pp_plan", None) or {}
    named = [path for path in plan if isinstance(_get(model, path), nn.ModuleList)]
    if len(named) == 1:
        return named[0]
    if len(named) > 1:
        raise _refusal(family, f"its base_model_pp_plan ({', '.join(plan)}) names {len(named)} lists of decoder "
                               f"layers, not one")
    found = layer_lists(model)
    if len(found) != 1:
        described = "describes no pipeline for it" if not plan else f"names no list of layers in its pp plan ({', '.join(plan)})"
        lists = f"{len(found)} lists of identical blocks ({', '.join(found)})" if found else "no list of identical blocks"
        raise _refusal(family, f"transformers {described} and it holds {lists}, not one sequence of decoder layers")
    return found[0]


def layer_lists(model: nn.Module) -> List[str]:
    """The outermost ModuleLists of the model holding more than one module, all of one class, each
    with parameters: where a family keeps its decoder blocks (``transformer.h``, ``model.decoder.layers``).
    A list inside another (a layer's experts) is part of that list's blocks."""
    found: List[str] = []
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < 2:
            continue
        if any(path.startswith(outer + ".") for outer in found):
            continue
        blocks = list(module)
        if len({type(block) for block in blocks}) == 1 and all(any(True for _ in b.parameters()) for b in blocks):
            found.append(path)
    return found


def _get(model: nn.Module, path: str) -> Optional[nn.Module]:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


@contextlib.contextmanager
def layers_replaced(model: nn.Module, path: str, stand_ins: List[nn.Module]) -> Iterator[None]:
    """The decoder layer list at ``path`` swapped for ``stand_ins`` while the block runs."""
    owner_path, _, name = path.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    layers = getattr(owner, name)
    setattr(owner, name, nn.ModuleList(stand_ins))
    try:
        yield
    finally:
        setattr(owner, name, layers)


def hidden_of(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, Tuple[Any, ...], Dict[str, Any]]:
    """(the hidden states, the other positional arguments, the keyword arguments) of a decoder
    layer's call: the hidden states are the first positional argument or ``hidden_states=``."""
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states"), (), kwargs


class _ProbeLayer(nn.Module):
    """Stands in for decoder layer ``index`` while the structure is probed: counts where the forward
    is (``probe.reached``) and checks its input is exactly what the previous layer returned."""

    def __init__(self, probe: "_Probe", index: int) -> None:
        super().__init__()
        self.probe, self.index = probe, index

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        hidden, _, _ = hidden_of(args, kwargs)
        probe = self.probe
        if self.index and hidden is not probe.returned:
            probe.problems.append(f"it does work between decoder layers {self.index - 1} and {self.index} (the input of "
                                  f"layer {self.index} is not what layer {self.index - 1} returned)")
        if self.index == 0:
            probe.first_shape = tuple(hidden.shape)
        probe.returned = hidden.clone()  # a new tensor: the next layer must receive this very one
        probe.reached = self.index + 1
        return probe.returned


class _Probe:
    """One forward of the model with its layers stood in for: which modules with parameters it
    calls before, between and after them."""

    def __init__(self, model: nn.Module, layers_path: str) -> None:
        self.model, self.layers_path = model, layers_path
        self.count = len(model.get_submodule(layers_path))
        self.reached = 0
        self.returned: Optional[torch.Tensor] = None
        self.first_shape: Optional[Tuple[int, ...]] = None  # of the hidden states decoder layer 0 gets
        self.problems: List[str] = []
        self.calls: Dict[str, set] = {}  # module path -> {"entry", "between", "exit"}

    def run(self, **inputs: Any) -> None:
        handles = []
        for path, module in self.model.named_modules():
            if path == self.layers_path or path.startswith(self.layers_path + "."):
                continue
            if any(True for _ in module.parameters(recurse=False)):
                handles.append(module.register_forward_pre_hook(self._called(path)))
        stand_ins = [_ProbeLayer(self, i) for i in range(self.count)]
        try:
            with layers_replaced(self.model, self.layers_path, stand_ins), torch.no_grad():
                self.model(**inputs, use_cache=False)
        finally:
            for handle in handles:
                handle.remove()

    def _called(self, path: str):
        def hook(module, args):
            where = "entry" if self.reached == 0 else "exit" if self.reached == self.count else "between"
            self.calls.setdefault(path, set()).add(where)
        return hook


@contextlib.contextmanager
def _evaluating(model: nn.Module) -> Iterator[None]:
    """Dropout off while probing: the probe must not draw from the random streams training uses."""
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


@contextlib.contextmanager
def _on_meta(model: nn.Module) -> Iterator[None]:
    """Every parameter and buffer swapped for one of its shape on the meta device while the block
    runs (ties kept): the probe computes nothing, draws no random number, and runs alike on a model
    whose tensors hold no memory yet (built on the meta device, given values after the split)."""
    twins: Dict[int, torch.Tensor] = {}
    swapped = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is None:
                    continue
                if id(tensor) not in twins:
                    empty = torch.empty_like(tensor, device="meta")
                    twins[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) \
                        if isinstance(tensor, nn.Parameter) else empty
                swapped.append((table, name, tensor))
                table[name] = twins[id(tensor)]
    try:
        yield
    finally:
        for table, name, tensor in swapped:
            table[name] = tensor


def _probe_inputs(model: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """A tiny input on the meta device and a ready 4-D additive mask: the family's own mask code
    would read values (.item()), which the meta device has not."""
    floating = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.get_default_dtype())
    ids = torch.zeros(1, _PROBE_TOKENS, dtype=torch.long, device="meta")
    mask = torch.zeros(1, 1, _PROBE_TOKENS, _PROBE_TOKENS, dtype=floating, device="meta")
    return ids, mask


def _followed(family: str, probe: _Probe, **inputs: Any) -> None:
    """``probe.run(**inputs)``, or the refusal naming what stopped it. Any error the forward raises
    with its layers stood in for (a value the meta device has not; a layer protocol the stand-ins do
    not speak: tuples unpacked, attributes read off a layer) means the pipeline could not run it
    either, and is refused here, before any step, rather than met on one stage mid-step."""
    try:
        probe.run(**inputs)
    except Exception as error:
        raise _refusal(family, f"its forward could not be followed with its decoder layers stood in for, on the "
                               f"meta device ({type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''})"
                       ) from error


def hf_pipeline_plan(model: nn.Module) -> HFPipelinePlan:
    """The model's pipeline plan, verified by probing its forward (see the module's docstring);
    ValueError naming the family and what it does that a pipeline would compute differently."""
    family = getattr(model.config, "model_type", type(model).__name__)
    layers_path = layer_list_path(model)
    base_path = model.base_model_prefix if _get(model, model.base_model_prefix) is model.base_model else ""
    ids, mask = _probe_inputs(model)
    hidden = getattr(model.config.get_text_config(), "hidden_size", None)
    with _evaluating(model), _on_meta(model):
        from_ids = _Probe(model, layers_path)
        _followed(family, from_ids, input_ids=ids, attention_mask=mask)
        problems = list(from_ids.problems)
        expected_shape = (1, _PROBE_TOKENS, hidden)
        if from_ids.reached != from_ids.count:
            problems.append(f"its forward called {from_ids.reached} of its {from_ids.count} decoder layers")
        elif hidden is not None and from_ids.first_shape != expected_shape:
            # Each stage rebuilds the layers' arguments from the hidden states as inputs_embeds: that
            # holds only when the layers take the embeddings' shape (not DeepSeek-V4's parallel streams).
            problems.append(f"its decoder layers take hidden states of shape {from_ids.first_shape}, not the "
                            f"embeddings' {expected_shape} (batch, tokens, hidden)")
        elif hidden is not None:
            # The last stage runs the forward from inputs_embeds: what it calls before layer 0 then
            # must hold no parameters (the first stage holds those).
            from_embeds = _Probe(model, layers_path)
            _followed(family, from_embeds, inputs_embeds=torch.zeros(*expected_shape, dtype=mask.dtype,
                                                                     device=mask.device), attention_mask=mask)
            early = sorted(path for path, where in from_embeds.calls.items() if "entry" in where)
            if early:
                problems.append(f"given inputs_embeds, its forward still calls {', '.join(early)} before the first "
                                f"decoder layer (the last stage, which runs the forward that way, does not hold it)")
    calls = from_ids.calls
    for path, where in sorted(calls.items()):
        if "between" in where:
            problems.append(f"it calls {path or type(model).__name__}, which has parameters, between decoder layers")
        elif where == {"entry", "exit"}:
            problems.append(f"it calls {path or type(model).__name__}, which has parameters, both before the first "
                            f"decoder layer and after the last")
    layer_parameters = {id(p) for p in model.get_submodule(layers_path).parameters()}
    used = {id(p) for path in calls for p in model.get_submodule(path).parameters(recurse=False)}
    unused = sorted(name for name, p in model.named_parameters() if id(p) not in layer_parameters | used)
    if unused:
        problems.append(f"its forward never calls the module of {', '.join(unused[:3])} outside the decoder layers "
                        f"(a parameter the pipeline would hold nowhere)")
    if problems:
        raise _refusal(family, "; ".join(problems))
    entry = tuple(path for path, where in calls.items() if where == {"entry"})
    exit_ = tuple(path for path, where in calls.items() if where == {"exit"})
    return HFPipelinePlan(family, base_path, layers_path, entry, exit_)

"""A model built without memory: its parameters on the meta device, given values by the strategy.

Build the model under ``torch.device("meta")`` (or ``hvdtrain.meta_parameters()``, which keeps the
buffers real, for models whose buffers are computed in ``__init__``) and the optimizer over it, as
usual: no memory is taken, no value computed. The Trainer gives every tensor its memory on the
rank's device and runs the model's initialization, from ``train.seed``, the same on every rank:

1. the construction's: each module's ``reset_parameters()`` (or ``_reset_parameters()``),
   children first, as torch's modules (and modules following their convention) call it at the end
   of their ``__init__`` when the model is built whole; each Hugging Face model's ``post_init``
   pass at the end of its own construction (a sub-model's first), its tied weights untied until
   then, as its ``tie_weights`` leaves them;
2. ``init_fn(module)`` given to the Trainer, applied to every module as ``Module.apply`` does.

All of it under the default dtype the model was built in (its parameters' dtype): a value computed
rather than drawn (a sinusoidal table, ``arange(n) / d``) takes the default dtype.

So the values equal the model built whole from the same seed (for torch's layers and Hugging Face
models; with ``init_fn``: built whole, then ``model.apply(init_fn)``): tests/mpi/test_deferred_init.py.
What cannot be replayed: initialization written inline in a module's ``__init__`` instead of its
``reset_parameters`` (move it there, as hvdtrain.examples.textlm does), and a model converted after
building (``.double()``): build it in the dtype it trains in.

ddp, zero1, zero2 and the parameter server start from a whole model on each rank: ``make_whole``
gives it its values in place. fsdp (fsdp/initialization.py) and tensor/pipeline parallelism
(model_parallel/initialization.py) never make it whole: every rank runs every step, with the tensors
each operation touches in memory, and keeps its own part.
A tensor nothing initializes (a module with its own parameters and no reset_parameters, a buffer
computed in ``__init__``) is an error that names it, not a silent garbage value: each starts as NaN
(or the integer minimum) and must not stay so.
"""
from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from hvdtrain.strategies.sharding.storage import allocate_storage, release_storage

InitFn = Callable[[nn.Module], None]
T = TypeVar("T")
Step = Tuple[str, nn.Module, Callable[[], None]]  # (module path, module, run its initialization)


def is_deferred(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are on the meta device; a mix of both is refused."""
    # A parameter an inline constructor replays may come out real under torch.device("meta") (torch.normal
    # with float mean and std ignores the device context): the rest of the model tells.
    replayed = {id(param) for module in model.modules() if inline_constructor(module) is not None
                for param in module.parameters(recurse=False)}
    on_meta = ({name: param.is_meta for name, param in model.named_parameters() if id(param) not in replayed}
               or {name: param.is_meta for name, param in model.named_parameters()})
    if any(on_meta.values()) and not all(on_meta.values()):
        meta = next(name for name, is_meta in on_meta.items() if is_meta)
        real = next(name for name, is_meta in on_meta.items() if not is_meta)
        raise ValueError(f"some of the model's parameters are on the meta device ({meta}) and some are not "
                         f"({real}): build the whole model under torch.device('meta') (hvdtrain gives it its "
                         f"values), or none of it")
    return any(on_meta.values())


@contextlib.contextmanager
def meta_parameters() -> Iterator[None]:
    """Parameters built inside the block go to the meta device as they are registered; buffers stay
    as built (``torch.device("meta")`` would lose the values a module computes into its buffers)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: Optional[nn.Parameter]) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def children_first(module: nn.Module, prefix: str = "") -> List[Tuple[str, nn.Module, nn.Module]]:
    """(path, module, the nearest Hugging Face model at or above it) in ``Module.apply``'s order."""
    pretrained = _hugging_face_model_class()
    order: List[Tuple[str, nn.Module, nn.Module]] = []

    def visit(module: nn.Module, path: str, owner: Optional[nn.Module]) -> None:
        if pretrained is not None and isinstance(module, pretrained):
            owner = module
        for name, child in module.named_children():
            visit(child, _join(path, name), owner)
        order.append((path, module, owner))

    visit(module, prefix, None)
    return order


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _hugging_face_model_class() -> Optional[type]:
    """transformers' PreTrainedModel when transformers is imported (a Hugging Face model imported it)."""
    if "transformers" not in sys.modules:
        return None
    from transformers import PreTrainedModel

    return PreTrainedModel


def _conv1d_constructor(module: nn.Module) -> None:
    nn.init.normal_(module.weight, std=0.02)
    nn.init.zeros_(module.bias)


def _diffllama_attention_constructor(module: nn.Module) -> None:
    # torch.normal(0, std, size=(head_dim,)) for each, in this order, after its projections.
    for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
        getattr(module, name).normal_(0, module.config.lambda_std_dev)


def _zero_bias_constructor(module: nn.Module) -> None:
    module.bias.zero_()  # nn.Parameter(torch.zeros(vocab_size)) in __init__, which no init pass writes


def _xielu_mlp_constructor(module: nn.Module) -> None:
    # Apertus' MLP builds its activation as ACT2CLS["xielu"](dtype=config.dtype) when hidden_act is
    # "xielu": alpha_p, alpha_n, beta and eps computed from the constructor's default floats, in
    # config.dtype. The same call, then its values into the module's tensors (no draw: nothing moves).
    activation = getattr(module, "act_fn", None)
    if type(activation).__name__ != "XIELUActivation" or module.config.hidden_act != "xielu":
        return
    built = type(activation)(dtype=module.config.dtype)
    with torch.no_grad():
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            getattr(activation, name).copy_(getattr(built, name))


# Modules of well-known libraries that initialize inline in __init__ (no reset_parameters): what
# their __init__ runs, replayed (class -> the same draws in the same order).
INLINE_CONSTRUCTORS: Dict[str, InitFn] = {
    "transformers.pytorch_utils.Conv1D": _conv1d_constructor,  # GPT-2's projections
    "transformers.models.data2vec.modeling_data2vec_text.Data2VecTextLMHead": _zero_bias_constructor,
    # Its lambdas: post_init draws them again, but the draws in __init__ move every later draw.
    "transformers.models.diffllama.modeling_diffllama.DiffLlamaAttention": _diffllama_attention_constructor,
    "transformers.models.apertus.modeling_apertus.ApertusMLP": _xielu_mlp_constructor,
    "transformers.models.apertus1p5.modeling_apertus1p5.Apertus1p5TextMLP": _xielu_mlp_constructor,
}


def inline_constructor(module: nn.Module) -> Optional[InitFn]:
    return INLINE_CONSTRUCTORS.get(f"{type(module).__module__}.{type(module).__qualname__}")


def construction_init(module: nn.Module) -> Optional[Callable[[], None]]:
    """What building ``module`` ran to initialize its own tensors, once its children were built."""
    inline = inline_constructor(module)
    if inline is not None:
        return lambda: inline(module)
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    return reset if callable(reset) else None


def initialization_steps(model: nn.Module, init_fn: Optional[InitFn] = None) -> List[Step]:
    """What building the model whole ran, in its order: each module's reset_parameters once its
    children are built; at the end of each Hugging Face model's construction its post_init pass
    over its modules (each initialized once: a sub-model's pass comes first); then init_fn on
    every module, children first, as ``model.apply(init_fn)``."""
    pretrained = _hugging_face_model_class()
    steps: List[Step] = []

    def visit(module: nn.Module, path: str) -> None:
        for name, child in module.named_children():
            visit(child, _join(path, name))
        construction = construction_init(module)
        if construction is not None:
            steps.append((path, module, construction))
        if pretrained is not None and isinstance(module, pretrained):
            custom = module.is_custom_code()
            steps.extend((sub_path, sub, lambda sub=sub, owner=owner: owner._initialize_weights(sub, custom))
                         for sub_path, sub, owner in children_first(module, path))

    visit(model, "")
    if init_fn is not None:
        steps.extend((path, module, lambda module=module: init_fn(module)) for path, module, _ in children_first(model))
    return steps


class DeferredInit:
    """The meta tensors of a model replaced by tensors on ``device`` that hold no memory yet (one
    for each distinct tensor: ties stay tied), the optimizer pointed at them, and the steps that
    give them their values.

    Args:
        model: the model built on the meta device.
        optimizer: its optimizer, pointed at the new tensors.
        device: where the tensors go.
        seed: seeds the initialization (train.seed), the same on every rank.
        init_fn: ``init_fn(module)`` applied to every module after the construction's, as ``Module.apply`` does.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, seed: int,
                 init_fn: Optional[InitFn] = None) -> None:
        if optimizer.state:
            raise ValueError("the optimizer of a model built on the meta device has state already: build it over "
                             "the model's parameters and do not step it before the Trainer")
        self.model, self.device, self.seed = model, device, seed
        self.build_dtype = build_dtype(model)
        self.steps = initialization_steps(model, init_fn)
        # name -> tensor without memory; and every further place of a tied tensor (the first keeps it).
        # A Hugging Face model ties its weights after its pass (tie_weights), so they are untied
        # while it runs; other models tie in __init__, before their initialization code.
        self.placeholders, ties = _replace_meta_tensors(model, optimizer, device)
        self.ties = ties if _is_hugging_face(model) else []
        for module in model.modules():  # a Hugging Face model built outside torch.device("meta") flagged them
            module.__dict__.pop("_is_hf_initialized", None)
        self.peak_bytes = 0  # the most bytes of the model's tensors in memory at once while initializing
        # How a strategy gave the values: "whole", or in its own pieces (fsdp's units, model
        # parallelism's slices and stages), never holding the whole model.
        self.granularity = "whole"

    @classmethod
    def of(cls, model: nn.Module, optimizer: torch.optim.Optimizer, device: torch.device, seed: int,
           init_fn: Optional[InitFn] = None) -> Optional["DeferredInit"]:
        """The model's deferred initialization, or None for a model whose parameters have values.

        Args:
            model: the model.
            optimizer: its optimizer.
            device: where the tensors go.
            seed: seeds the initialization (train.seed).
            init_fn: ``init_fn(module)`` applied to every module after the construction's.
        """
        if is_deferred(model):
            return cls(model, optimizer, device, seed, init_fn)
        if init_fn is not None:
            raise ValueError("init_fn initializes a model built on the meta device, and this model's parameters "
                             "have values already: drop init_fn, or build the model under torch.device('meta')")
        return None

    @property
    def tie_bytes(self) -> int:
        """The scratch tensors that stand in for the later places of tied tensors while initializing."""
        return sum(nbytes(tensor) for _, _, tensor in self.ties)

    def make_whole(self) -> None:
        """Every tensor in memory and initialized, the same on every rank (local)."""
        for tensor in self.placeholders.values():
            allocate_storage(tensor)
            mark_unset(tensor)
        self.peak_bytes = sum(nbytes(t) for t in self.placeholders.values()) + self.tie_bytes
        self.run()
        unset = [name for name, tensor in self.placeholders.items() if is_unset(tensor)]
        if unset:
            raise ValueError(self.unset_message(unset))

    def run(self) -> None:
        """Every step from ``seed``, with the caller's own random streams left as they were. A Hugging Face model's tied tensors are untied meanwhile, as
        they were while it was built whole: each later place writes into a scratch tensor, and the
        tie keeps the first place's values (what its tie_weights does after its pass)."""
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        for slots, name, tensor in self.ties:
            scratch = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
            slots[name] = nn.Parameter(scratch, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else scratch
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad(), _hugging_face_guard(self.model), \
                    default_dtype(self.build_dtype):
                torch.manual_seed(self.seed)
                for _, _, step in self.steps:
                    step()
        finally:
            for slots, name, tensor in self.ties:
                slots[name] = tensor

    def _owner_class(self, name: str) -> Optional[str]:
        try:
            return type(self.model.get_submodule(name.rpartition(".")[0])).__name__
        except AttributeError:  # a name of the model as a strategy split it
            return None

    def unset_message(self, names: List[str]) -> str:
        """The tensors by name, and the classes whose __init__ gave them values no pass replays."""
        classes = sorted({owner for owner in map(self._owner_class, names) if owner})
        owners = f" (in {', '.join(classes)})" if classes else ""
        return (f"{', '.join(names[:5])}{' ...' if len(names) > 5 else ''} built on the meta device and "
                f"nothing initialized {'it' if len(names) == 1 else 'them'}{owners}: its module has no reset_parameters() "
                f"(it gave the value inline in __init__, or computed a buffer there, and no init pass writes it). "
                f"Pass init_fn(module) to the Trainer to initialize it, build the model with "
                f"hvdtrain.meta_parameters() to keep buffers as built, or build the model whole")


# What torch.set_default_dtype accepts.
DEFAULT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def build_dtype(model: nn.Module) -> torch.dtype:
    """The default dtype the model was built under, as far as its parameters tell: their floating
    dtype when they all share one (``from_config(dtype=...)`` and ``torch.set_default_dtype`` build
    so), else the current default. Values computed rather than drawn (a sinusoidal table, rotary
    frequencies: ``torch.arange(n) / d`` takes the default dtype) come out as the model built whole
    only when replayed under it."""
    dtypes = {param.dtype for param in model.parameters() if param.is_floating_point()}
    if len(dtypes) == 1 and next(iter(dtypes)) in DEFAULT_DTYPES:
        return dtypes.pop()
    return torch.get_default_dtype()


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors created inside take ``dtype`` by default (a model built, or its initialization replayed)."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def _is_hugging_face(model: nn.Module) -> bool:
    pretrained = _hugging_face_model_class()
    return pretrained is not None and isinstance(model, pretrained)


def _hugging_face_guard(model: nn.Module):
    """transformers' guard around its own pass (torch.nn.init's functions respect its flags)."""
    if not _is_hugging_face(model):
        return contextlib.nullcontext()
    from transformers.initialization import guard_torch_init_functions

    return guard_torch_init_functions()


Tie = Tuple[Dict[str, Optional[torch.Tensor]], str, torch.Tensor]  # (a module's slots, name, the tied tensor)


def _replace_meta_tensors(model: nn.Module, optimizer: torch.optim.Optimizer,
                          device: torch.device) -> Tuple[Dict[str, torch.Tensor], List[Tie]]:
    replaced: Dict[int, torch.Tensor] = {}
    named: Dict[str, torch.Tensor] = {}
    ties: List[Tie] = []
    for path, module in model.named_modules():
        replays_its_parameters = inline_constructor(module) is not None
        for slots, is_parameter in ((module._parameters, True), (module._buffers, False)):
            for name, tensor in slots.items():
                if tensor is None or not (tensor.is_meta or (is_parameter and replays_its_parameters)):
                    continue
                if tensor.dtype == torch.bool:
                    raise ValueError(f"{_join(path, name)}: a boolean buffer built on the meta device cannot be told "
                                     f"apart from an initialized one; build the model with "
                                     f"hvdtrain.meta_parameters(), which keeps buffers as built")
                if id(tensor) in replaced:
                    ties.append((slots, name, replaced[id(tensor)]))
                else:
                    empty = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
                    release_storage(empty)
                    if is_parameter:
                        empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
                        empty.__dict__.update({k: v for k, v in tensor.__dict__.items() if k != "_is_hf_initialized"})
                    replaced[id(tensor)] = empty
                    named[_join(path, name)] = empty
                slots[name] = replaced[id(tensor)]
    for group in optimizer.param_groups:
        group["params"] = [replaced.get(id(param), param) for param in group["params"]]
    return named, ties


def touched(args: Any, kwargs: Any, by_storage: Mapping[int, T]) -> List[T]:
    """What an operation's tensors name in ``by_storage`` (keyed by their storages, which a tensor's
    views share), each once, in the order the operation gives its tensors: for the dispatch modes
    that bring a deferred model's pieces into memory as its initialization touches them."""
    found: List[T] = []
    for value in tree_leaves((args, kwargs or {})):
        if isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_meta:
            entry = by_storage.get(value.untyped_storage()._cdata)
            if entry is not None and entry not in found:
                found.append(entry)
    return found


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def mark_unset(tensor: torch.Tensor) -> None:
    """NaN, or the integer minimum: what no initialization writes."""
    with torch.no_grad():
        tensor.fill_(float("nan") if tensor.is_floating_point() else torch.iinfo(tensor.dtype).min)


def is_unset(tensor: torch.Tensor) -> bool:
    if tensor.is_floating_point():
        return bool(torch.isnan(tensor).any())
    return bool((tensor == torch.iinfo(tensor.dtype).min).any())

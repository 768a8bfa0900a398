"""Whether a layer of a class of its own can be split without changing what it computes.

A tensor plan names a family's layers by style, and the split layer computes what nn.Linear or
nn.Embedding computes on this rank's slice. A family that subclasses them to do more (Gemma's
embedding multiplies the lookup by sqrt(hidden)) would lose that work silently if its layer were
replaced by a plain split one: the run trains, and trains something else. So a subclass's forward
is read before the split: it is kept, around the split lookup, when all it does with the table is
call ``super().forward(...)`` (hvdtrain.parallel.tensor.layers.VocabParallelEmbedding puts the split lookup
there); anything else (its own use of ``self.weight``, F.embedding or F.linear on it, a forward
whose source cannot be read) is refused by name before the first step.
"""
from __future__ import annotations

import ast
import inspect
import textwrap
from typing import List, Optional

from torch import nn

# What reads the table itself instead of through the base class's forward.
_OWN_USES = {"weight", "bias"}
_OWN_CALLS = {"embedding", "linear", "embedding_bag", "matmul", "mm", "bmm", "addmm", "einsum"}


def _forwards_between(cls: type, base: type) -> List[type]:
    """The classes from ``cls`` down to (not including) ``base`` that define a forward of their own."""
    return [klass for klass in cls.__mro__[: cls.__mro__.index(base)] if "forward" in vars(klass)]


def _calls_super_forward(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "forward"
            and isinstance(node.func.value, ast.Call) and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super")


def _problem_in(klass: type) -> Optional[str]:
    """Why ``klass.forward`` cannot be kept around a split base forward, or None when it can."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(vars(klass)["forward"])))
    except (OSError, TypeError, SyntaxError):
        return f"the source of {klass.__name__}.forward cannot be read, so what it does cannot be checked"
    calls_super = False
    for node in ast.walk(tree):
        if _calls_super_forward(node):
            calls_super = True
        elif (isinstance(node, ast.Attribute) and node.attr in _OWN_USES and isinstance(node.value, ast.Name)
              and node.value.id == "self" and not _only_metadata(tree, node)):
            # (Asking self.weight its dtype or device changes nothing: only its values would.)
            return f"{klass.__name__}.forward uses self.{node.attr} itself"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _OWN_CALLS:
            return f"{klass.__name__}.forward computes with {ast.unparse(node.func)} itself"
    if not calls_super:
        return f"{klass.__name__}.forward does not call super().forward(...)"
    return None


def _only_metadata(tree: ast.AST, use: ast.Attribute) -> bool:
    """Whether this ``self.weight`` is only asked its dtype, device or shape (Gemma: ``.to(self.weight.dtype)``)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.value is use:
            return node.attr in ("dtype", "device", "shape")
    return False


def own_forward_problem(module: nn.Module, base: type) -> Optional[str]:
    """None when ``module`` (an instance of ``base`` or of a subclass) computes what ``base`` does
    around its base's forward, so a split ``base`` layer can stand beneath it; else the reason."""
    for klass in _forwards_between(type(module), base):
        problem = _problem_in(klass)
        if problem is not None:
            return problem
    return None


def has_own_forward(module: nn.Module, base: type) -> bool:
    return type(module).forward is not base.forward

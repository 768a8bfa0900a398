"""Every public function of hvdtrain that takes more than three parameters says what each one is, in
a Google-style ``Args:`` section of its docstring (read from the source with ast: nothing imported).

The rule:
- public: the function's name, its class's name and every part of its module path do not start
  with ``_`` (a package's ``__init__.py`` and ``__main__.py`` count as the package); a public class's
  ``__init__`` is public, and its ``Args:`` may be in the class docstring instead; functions nested in
  functions and ``@overload`` stubs are not checked;
- parameters counted: every positional, keyword-only, ``*args`` and ``**kwargs`` parameter, one each;
  a method's first parameter (``self``, ``cls``) is not counted, a ``@staticmethod``'s is;
- more than three counted parameters: each must be named at the start of a line of the ``Args:``
  section (``name:``, ``name (type):``, ``*args:`` or ``args:``).
"""
import ast
import re
from pathlib import Path
from typing import Iterator, List, Optional, Set, Tuple

PACKAGE = Path(__file__).resolve().parents[2] / "hvdtrain"
MAX_PARAMETERS = 3  # more than this many counted parameters: an Args: section is required

FunctionNode = (ast.FunctionDef, ast.AsyncFunctionDef)


def decorated(function: ast.AST, name: str) -> bool:
    for decorator in function.decorator_list:
        if (isinstance(decorator, ast.Name) and decorator.id == name) or (
                isinstance(decorator, ast.Attribute) and decorator.attr == name):
            return True
    return False


def parameters(function: ast.AST, is_method: bool) -> List[str]:
    """The counted parameters' names, without their stars."""
    arguments = function.args
    names = [argument.arg for argument in arguments.posonlyargs + arguments.args]
    if is_method and not decorated(function, "staticmethod") and names:
        names = names[1:]
    if arguments.vararg:
        names.append(arguments.vararg.arg)
    names += [argument.arg for argument in arguments.kwonlyargs]
    if arguments.kwarg:
        names.append(arguments.kwarg.arg)
    return names


def args_section(docstring: Optional[str]) -> Optional[Set[str]]:
    """The names an ``Args:`` section documents, or None without one."""
    lines = (docstring or "").splitlines()
    for index, line in enumerate(lines):
        if line.strip() != "Args:":
            continue
        indent = len(line) - len(line.lstrip())
        names: Set[str] = set()
        for entry in lines[index + 1:]:
            if not entry.strip():
                continue
            if len(entry) - len(entry.lstrip()) <= indent:
                break
            match = re.match(r"\s*\*{0,2}(\w+)\s*(\([^)]*\))?\s*:", entry)
            if match:
                names.add(match.group(1))
        return names
    return None


def module_name(path: Path) -> Optional[str]:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    if any(part.startswith("_") and part not in ("__init__", "__main__") for part in parts):
        return None
    return ".".join(part for part in parts if part != "__init__")


def public_functions() -> Iterator[Tuple[str, List[str], Set[str]]]:
    """(qualified name, counted parameters, names its Args: section documents) of every public
    function or method with more than MAX_PARAMETERS counted parameters."""
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path)
        if module is None:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))

        def walk(body: list, prefix: str, owner: Optional[ast.ClassDef]) -> Iterator[Tuple[str, List[str], Set[str]]]:
            for node in body:
                if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                    yield from walk(node.body, f"{prefix}{node.name}.", node)
                elif isinstance(node, FunctionNode):
                    constructor = owner is not None and node.name == "__init__"
                    if (node.name.startswith("_") and not constructor) or decorated(node, "overload"):
                        continue
                    names = parameters(node, owner is not None)
                    if len(names) <= MAX_PARAMETERS:
                        continue
                    documented = args_section(ast.get_docstring(node))
                    if documented is None and constructor:
                        documented = args_section(ast.get_docstring(owner))
                    yield f"{prefix}{node.name}", names, documented or set()

        yield from walk(tree.body, f"{module}.", None)


def test_args_sections_name_every_parameter():
    missing = {name: [parameter for parameter in names if parameter not in documented]
               for name, names, documented in public_functions()}
    missing = {name: parameters_ for name, parameters_ in missing.items() if parameters_}
    assert not missing, "public functions whose docstring's Args: section lacks parameters:\n" + "\n".join(
        f"  {name}: {', '.join(parameters_)}" for name, parameters_ in sorted(missing.items()))


def test_the_rule_reads_google_style_sections():
    source = '''
def f(a, b, *rest, c, **options):
    """Does f.

    Args:
        a: the first.
        b (int): the second,
            over two lines.
        *rest: more.
        c: a keyword.
        **options: the rest.

    Returns:
        nothing.
    """
'''
    function = ast.parse(source).body[0]
    assert parameters(function, is_method=False) == ["a", "b", "rest", "c", "options"]
    assert args_section(ast.get_docstring(function)) == {"a", "b", "rest", "c", "options"}
    assert args_section("No section.") is None

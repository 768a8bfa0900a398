"""Which tests/mpi files each launch of scripts/run_tests.sh runs is said by the files' own markers
(registered in setup.cfg; the script selects with -m over tests/mpi). Read here without MPI and without
collecting (the files import torch and transformers): the markers from each file's source, the
launches from the script's on_mpirun/on_gloo lines. A test left out of every launch, or put in a
launch that does not exist, would pass unnoticed; these fail instead."""
import ast
import configparser
import re
import shlex
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "run_tests.sh"
MPI_FILES = sorted((ROOT / "tests" / "mpi").glob("test_*.py"))
# Registered by pytest itself and by its plugins (pytest-timeout, pytest-mpi), not in setup.cfg.
PLUGIN_MARKERS = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "timeout",
                  "mpi", "mpi_skip", "mpi_xfail", "mpi_break"}
# np<N> runs at N ranks under mpirun, gloo_np<N> at N ranks under horovodrun --gloo.
WORLD_SIZE_MARKER = re.compile(r"(gloo_)?np(\d+)$")


def registered():
    """setup.cfg's markers: name -> its line (a marker taking a reason is registered as name(reason))."""
    parser = configparser.ConfigParser(interpolation=None)
    parser.read(ROOT / "setup.cfg")
    lines = [line.strip() for line in parser["tool:pytest"]["markers"].splitlines() if line.strip()]
    return {re.match(r"\w+", line).group(0): line for line in lines}


def launches():
    """The script's MPI launches: (function, key, ranks, pytest arguments), in order."""
    found = []
    for line in SCRIPT.read_text().splitlines():
        match = re.match(r"(on_mpirun|on_gloo) (\S+) (\S+) \d+ (.*)$", line)
        if match:
            function, key, ranks, arguments = match.groups()
            found.append((function, key, ranks.strip('"'), shlex.split(arguments)))
    return found


def expression(arguments):
    """The launch's -m expression, or None: every test of the paths."""
    return arguments[arguments.index("-m") + 1] if "-m" in arguments else None


def mark_calls(tree):
    """(name, call or None) of every pytest.mark.<name> in the source, decorators and params included."""
    calls = {id(node.func): node for node in ast.walk(tree) if isinstance(node, ast.Call)}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "pytest"):
            yield node.attr, calls.get(id(node))


def module_marks(path):
    """The module-wide markers (pytestmark): name -> the reason= given, or None."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "pytestmark" for target in node.targets):
            marks = {}
            for name, call in mark_calls(node.value):
                reason = None
                if call is not None:
                    reason = next((keyword.value.value for keyword in call.keywords
                                   if keyword.arg == "reason" and isinstance(keyword.value, ast.Constant)), None)
                marks[name] = reason
            return marks
    return {}


def selects(expr, marks):
    """What pytest's -m does with a file whose every test carries these markers (and, or, not, parentheses)."""
    if expr is None:
        return True
    tokens = re.findall(r"\(|\)|\w+", expr)
    assert "".join(tokens) == re.sub(r"\s", "", expr), f"-m {expr!r}: only names, and, or, not and parentheses"
    python = " ".join(t if t in ("and", "or", "not", "(", ")") else str(t in marks) for t in tokens)
    return eval(python, {"__builtins__": {}})  # True/False, and/or/not: nothing else survives the check above


def selecting(expr):
    """The markers a -m expression selects by (not those it leaves out: "not skip_gloo")."""
    return set(re.findall(r"(?<!not )\b(?!and\b|or\b|not\b)(\w+)", expr or ""))


def test_every_launch_line_is_read():
    """The checks below see every launch: each on_mpirun/on_gloo call parses, and both kinds are there."""
    calls = [line for line in SCRIPT.read_text().splitlines() if re.match(r"on_(mpirun|gloo) ", line)]
    assert len(calls) == len(launches()), calls
    assert {function for function, _, _, _ in launches()} == {"on_mpirun", "on_gloo"}


def test_every_marker_is_registered():
    """--strict-markers fails a misspelt marker at collection, in the launches; this fails it in the
    one-process launch, before any of them."""
    known = set(registered()) | PLUGIN_MARKERS
    unknown = {path.name: sorted({name for name, _ in mark_calls(ast.parse(path.read_text()))} - known)
               for path in (ROOT / "tests" / "mpi").glob("*.py")}
    unknown = {name: markers for name, markers in unknown.items() if markers}
    assert not unknown, f"unregistered markers (setup.cfg [tool:pytest] markers): {unknown}"


def test_every_file_runs_in_the_launch_at_np_ranks_under_mpi():
    """Nothing in tests/mpi silently never runs: the launch at $NP ranks (2) under MPI takes the whole directory."""
    (arguments,) = [arguments for function, key, ranks, arguments in launches()
                    if function == "on_mpirun" and ranks == "$NP"]
    assert arguments == ["tests/mpi"], f"the launch at $NP ranks under MPI must run every test: {arguments}"
    assert MPI_FILES and all(selects(expression(arguments), module_marks(path)) for path in MPI_FILES)


def test_every_launch_selects_over_the_directory_by_registered_markers():
    """No file lists (the markers say it), no marker the script names that setup.cfg does not know."""
    names = set(registered())
    for function, key, ranks, arguments in launches():
        expr = expression(arguments)
        paths = [argument for argument in arguments if argument not in ("-m", expr)]
        assert paths == ["tests/mpi"], f"{key}: {paths}"
        unknown = set(re.findall(r"\w+", expr or "")) - {"and", "or", "not"} - names
        assert not unknown, f"{key}: -m {expr!r} names unregistered markers {sorted(unknown)}"


def test_every_world_size_marker_is_a_launch_at_that_size():
    """np<N> is selected only by mpirun at N ranks, gloo_np<N> only by horovodrun --gloo at N, and every
    marker setup.cfg registers (but pytest-mpi's own mpi) is one some launch selects by or leaves out."""
    named = set()
    for function, key, ranks, arguments in launches():
        expr = expression(arguments)
        named |= set(re.findall(r"\w+", expr or "")) - {"and", "or", "not"}
        for marker in selecting(expr):
            size = WORLD_SIZE_MARKER.match(marker)
            if size:
                wanted = ("on_gloo" if size.group(1) else "on_mpirun", size.group(2))
                assert (function, ranks) == wanted, f"{key}: -m {expr!r} selects {marker} in {function} at {ranks}"
    unused = set(registered()) - {"mpi"} - named
    assert not unused, f"registered in setup.cfg but no launch of run_tests.sh selects by them: {sorted(unused)}"


def test_every_launch_marker_gives_its_reason():
    """A file says why it runs in a launch (or is left out of one), beside the marker, once for the file."""
    takes_reason = {name for name, line in registered().items() if line.startswith(f"{name}(reason)")}
    wrong = {}
    for path in MPI_FILES:
        marks = module_marks(path)
        if any(not marks[name] for name in takes_reason & set(marks)):
            wrong[path.name] = "a launch marker without reason=..."
        # Per file (pytestmark), so a file's launches are read in one place, and here without collecting.
        if {name for name, _ in mark_calls(ast.parse(path.read_text()))} & takes_reason - set(marks):
            wrong[path.name] = "a launch marker on single tests, not in pytestmark"
        if {"skip_gloo", "gloo_np4"} <= set(marks):
            wrong[path.name] = "left out of Gloo at $NP ranks yet run over Gloo at 4"
    assert not wrong, wrong

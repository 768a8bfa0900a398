"""The tree's import direction, checked on every module's imports (at module level and inside
functions): the benchmarks are a leaf, each package imports only the layers below it, and the
tools that run on login nodes import neither torch nor Horovod."""
import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator, Tuple

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "hvdtrain"

# Each package's layer: a module imports only packages of a lower layer, and its own package.
LAYERS: Dict[str, int] = {
    "common": 0,                                     # no torch, no Horovod, nothing of hvdtrain
    "config": 1, "distributed": 1,                   # settings; Horovod start-up and collectives
    "launch": 2, "planner": 2, "data": 2, "components": 2,
    "parallel": 3,                                   # the mesh, tensor and pipeline parallelism
    "strategies": 4,
    "checkpoint": 5, "observability": 5, "fault_tolerance": 5,
    "weights": 6,                                    # import and export: reads checkpoint sources
    "examples": 6,
    "top": 7,                                        # hvdtrain/__init__.py, session.py, trainer.py, loop.py
    "bench": 8, "verify": 8,                         # leaves: they drive the Trainer, nothing imports them
    "cli": 9,
}
# Modules that run on login nodes or anywhere matplotlib does: neither torch nor Horovod at import.
LIGHT = ("hvdtrain.common", "hvdtrain.config", "hvdtrain.launch", "hvdtrain.planner",
         "hvdtrain.distributed.environments", "hvdtrain.observability.plots", "hvdtrain.observability.figures",
         "hvdtrain.cli")
HEAVY_INSIDE_LIGHT = {"hvdtrain.launch.probe": "runs inside a short job that the doctor launches"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("session", "trainer", "loop", "parts"):
        return "top"
    return parts[1]


def modules() -> Iterator[Tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        yield module_name(path), ast.parse(path.read_text(), str(path))


def hvdtrain_imports(tree: ast.Module) -> Iterator[Tuple[str, int, bool]]:
    """(imported hvdtrain module, line, at module level)."""
    top = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hvdtrain":
            yield node.module, node.lineno, id(node) in top
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hvdtrain":
                    yield alias.name, node.lineno, id(node) in top


@pytest.mark.parametrize("leaf", ["bench", "verify"])
def test_nothing_outside_a_leaf_and_the_command_line_imports_it(leaf):
    """The benchmarks and the layout checks drive the Trainer; nothing of the library depends on them."""
    offenders = [f"{module}:{line} imports {imported}" for module, tree in modules()
                 if package_of(module) not in (leaf, "cli")
                 for imported, line, _ in hvdtrain_imports(tree)
                 if imported == f"hvdtrain.{leaf}" or imported.startswith(f"hvdtrain.{leaf}.")]
    assert not offenders, f"hvdtrain.{leaf} is a leaf: " + "; ".join(offenders)


def test_every_package_imports_only_the_layers_below_it():
    assert set(LAYERS) == {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists()} | {"top"}
    offenders = []
    for module, tree in modules():
        if module.endswith(".__main__"):  # an entry point (python -m): above everything by nature
            continue
        mine = package_of(module)
        for imported, line, _ in hvdtrain_imports(tree):
            theirs = package_of(imported)
            if theirs == mine or LAYERS[theirs] < LAYERS[mine]:
                continue
            offenders.append(f"{module}:{line} ({mine}, layer {LAYERS[mine]}) imports {imported} "
                             f"({theirs}, layer {LAYERS[theirs]})")
    assert not offenders, "imports against the layers:\n" + "\n".join(offenders)


# The end of a check run in a fresh interpreter: fails naming what loaded torch or Horovod.
LOADED_HEAVY = ("heavy = [m for m in ('torch', 'horovod') if m in sys.modules]\n"
                "sys.exit(f'{what} imports {{heavy}}' if heavy else 0)\n")


def assert_runs_clean(code: str) -> None:
    """``code`` in a fresh interpreter exits 0 (its message, what loaded torch or Horovod, otherwise)."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_login_node_tools_import_neither_torch_nor_horovod():
    light = ["hvdtrain"] + sorted(module for module, _ in modules()
                                  if any(module == root or module.startswith(root + ".") for root in LIGHT)
                                  and module not in HEAVY_INSIDE_LIGHT and not module.endswith(".__main__"))
    # One process imports them one by one: the first after which torch or Horovod is loaded is named.
    code = ("import importlib, sys\n"
            f"for name in {light!r}:\n"
            "    importlib.import_module(name)\n"
            "    heavy = [m for m in ('torch', 'horovod') if m in sys.modules]\n"
            "    if heavy:\n"
            "        sys.exit(f'{name} imports {heavy}')\n"
            "import hvdtrain.cli\n"
            "hvdtrain.cli.build_parser()  # every command's options: --help stays instant\n"
            + LOADED_HEAVY.format(what="building the hvdtrain parser"))
    assert_runs_clean(code)
    assert len(light) > 30, light


def test_a_train_config_is_built_and_checked_without_torch_or_horovod():
    """A login node builds and checks settings (a strategy's refusals included) without paying for torch."""
    code = ("import sys, hvdtrain\n"
            "hvdtrain.TrainConfig()\n"
            "hvdtrain.TrainConfig(strategy='zero1', tensor_parallel=2, pipeline_parallel=2)\n"
            "try:\n"
            "    hvdtrain.TrainConfig(strategy='fsdp', compile=True)\n"
            "except ValueError as refusal:\n"
            "    assert 'compile' in str(refusal)\n"
            "else:\n"
            "    sys.exit('fsdp with compile was not refused')\n"
            + LOADED_HEAVY.format(what="TrainConfig"))
    assert_runs_clean(code)

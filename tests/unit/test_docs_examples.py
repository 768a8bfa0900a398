"""The documentation's runnable examples run: every fenced block right after a `<!-- run -->` line,
in README.md and docs/, exits 0 within its time limit.

Only cheap blocks are marked (settings, --help, --print-config, plan): each runs in a subprocess
from the repository root, with this tree's hvdtrain first on the path. ```python blocks run with this
interpreter; ```bash blocks under bash -e, where `hvdtrain` and `python` are this tree's and this
interpreter's (not whatever an installed console script points at).
"""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- run -->"
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.MULTILINE | re.DOTALL)
TIME_LIMIT = 60


def runnable_blocks():
    """(file, line, language, code) of every block marked runnable."""
    blocks = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        for match in re.finditer(re.escape(MARKER) + r"[ \t]*\n", text):
            fence = FENCE.match(text, match.end())
            line = text.count("\n", 0, match.start()) + 1
            if fence is None:  # a marker must be followed at once by its block
                blocks.append((path.relative_to(ROOT), line, None, ""))
                continue
            blocks.append((path.relative_to(ROOT), line, fence.group(1), fence.group(2)))
    return blocks


BLOCKS = runnable_blocks()


def test_the_docs_mark_runnable_examples():
    files = {str(path) for path, *_ in BLOCKS}
    assert len(BLOCKS) >= 5 and "README.md" in files, BLOCKS


@pytest.fixture(scope="module")
def shims(tmp_path_factory):
    """A bin directory whose `hvdtrain` and `python` are this tree's CLI and this interpreter."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "hvdtrain").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m hvdtrain.cli "$@"\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("path,line,language,code", BLOCKS, ids=[f"{p}:{n}" for p, n, *_ in BLOCKS])
def test_a_runnable_block_exits_0(path, line, language, code, shims, tmp_path):
    assert language in ("python", "bash"), f"{path}:{line}: {MARKER} must be followed by a ```python or ```bash block"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PATH=f"{shims}{os.pathsep}{os.environ['PATH']}", MPLBACKEND="Agg")
    command = [sys.executable, "-c", code] if language == "python" else ["bash", "-e", "-c", code]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIME_LIMIT)
    assert result.returncode == 0, f"{path}:{line} exited {result.returncode}\n{code}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"
    assert result.stdout.strip(), f"{path}:{line} printed nothing"


def test_one_version_users_can_pin():
    """setup.cfg reads the version from hvdtrain.__version__, and the changelog has its entry."""
    from setuptools.config.setupcfg import read_configuration

    import hvdtrain

    version = read_configuration(str(ROOT / "setup.cfg"))["metadata"]["version"]
    assert version == hvdtrain.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    assert f"## {version} " in (ROOT / "CHANGELOG.md").read_text()

"""scripts/setup.sh finds the CUDA toolkit behind a wrapper nvcc and refuses an NCCL build that a node
without the toolkit could not load (torch built for another CUDA major than the toolkit's)."""
import subprocess
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def functions() -> str:
    """setup.sh's helper functions, without its steps (which install things)."""
    text = SETUP.read_text()
    return text[text.index("say() {"):text.index("SETUP_START=")]


@pytest.fixture
def toolkit(tmp_path):
    """A CUDA 13.0 toolkit reached only through a wrapper script on PATH, as /usr/local/bin/nvcc here."""
    root = tmp_path / "cuda-13.0"
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\n"
                    f'case "$*" in *--dryrun*) echo "#\\$ _HERE_={root}/bin" >&2;;\n'
                    '  *--version*) echo "Cuda compilation tools, release 13.0, V13.0.88";; esac\n')
    wrappers = tmp_path / "wrappers"
    wrappers.mkdir()
    (wrappers / "nvcc").write_text(f'#!/bin/sh\nexec {nvcc} "$@"\n')
    for script in (nvcc, wrappers / "nvcc"):
        script.chmod(0o755)
    return root, wrappers


def run(wrappers: Path, call: str, **env) -> subprocess.CompletedProcess:
    script = functions() + call
    environment = {"PATH": f"{wrappers}:/usr/bin:/bin", **env}
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=environment, timeout=60)


def test_the_toolkit_behind_a_wrapper_nvcc_is_found(toolkit):
    root, wrappers = toolkit
    result = run(wrappers, "cuda_toolkit_root")
    assert (result.returncode, result.stdout.strip()) == (0, str(root))


def test_a_toolkit_without_headers_is_refused_with_what_to_set(toolkit):
    root, wrappers = toolkit
    (root / "include" / "cuda_runtime.h").unlink()
    result = run(wrappers, "cuda_toolkit_root")
    assert result.returncode == 1 and "set CUDA_HOME" in result.stderr


@pytest.mark.parametrize("torch_cuda, env, outcome", [
    ("13.0", {}, "nccl"),                      # the toolkit's own major: NCCL is built
    ("none", {}, "no nccl"),                   # a CPU torch
    ("12.4", {}, "refused"),                   # libcudart.so.13 would be missing beside torch's 12
])
def test_nccl_only_with_the_toolkit_of_torchs_cuda_major(toolkit, torch_cuda, env, outcome):
    _, wrappers = toolkit
    result = run(wrappers, f'if want_nccl {torch_cuda}; then echo nccl; else echo "no nccl"; fi', **env)
    if outcome == "refused":
        assert result.returncode == 1
        assert "is built for CUDA 12.4" in result.stderr and "set CUDA_HOME" in result.stderr.replace("Set", "set")
    else:
        assert (result.returncode, result.stdout.strip().splitlines()[-1]) == (0, outcome)

"""scripts/setup.sh finds the CUDA toolkit behind a wrapper nvcc and refuses an NCCL build that a node
without the toolkit could not load (torch built for another CUDA major than the toolkit's), unless told
to build without NCCL against the CUDA runtime torch brought (HOROVOD_NCCL=0)."""
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"
BASH = shutil.which("bash")  # found here: a test may give the script a PATH without it


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
    environment = {"PATH": f"{wrappers}:/usr/bin:/bin", "HOROVOD_NCCL": "auto", **env}
    return subprocess.run([BASH, "-c", script], capture_output=True, text=True, env=environment, timeout=60)


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
    ("12.4", {"HOROVOD_NCCL": "0"}, "no nccl"),  # told to build against torch's own CUDA 12 runtime
    ("13.0", {"HOROVOD_NCCL": "0"}, "no nccl"),
    ("13.0", {"HOROVOD_NCCL": "1"}, "nccl"),
])
def test_nccl_only_with_the_toolkit_of_torchs_cuda_major(toolkit, torch_cuda, env, outcome):
    _, wrappers = toolkit
    result = run(wrappers, f'if want_nccl {torch_cuda}; then echo nccl; else echo "no nccl"; fi', **env)
    if outcome == "refused":
        assert result.returncode == 1
        assert "is built for CUDA 12.4" in result.stderr and "set CUDA_HOME" in result.stderr.replace("Set", "set")
        assert "HOROVOD_NCCL=0" in result.stderr  # the third way out
    else:
        assert (result.returncode, result.stdout.strip().splitlines()[-1]) == (0, outcome)


@pytest.mark.parametrize("setting, outcome", [("auto", "no nccl: no CUDA toolkit here"), ("1", "refused")])
def test_without_any_toolkit_auto_builds_without_nccl_and_1_refuses(tmp_path, setting, outcome):
    result = run(tmp_path, 'if want_nccl 12.8; then echo nccl; else echo "no nccl: $WITHOUT_NCCL_REASON"; fi',
                 HOROVOD_NCCL=setting)
    if outcome == "refused":
        assert result.returncode == 1 and "HOROVOD_NCCL=1" in result.stderr and "CUDA 12 toolkit" in result.stderr
    else:
        assert (result.returncode, result.stdout.strip()) == (0, outcome)


def fake_torch(site: Path, cuda: str, runtime_files=("lib/libcudart.so.12", "include/cuda_runtime.h")) -> None:
    """A site directory holding a stand-in torch built for CUDA ``cuda`` and an nvidia runtime wheel's files."""
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(f"class version:\n    cuda = {cuda!r}\n")
    for name in runtime_files:
        path = site / "nvidia" / "cuda_runtime" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")


def test_the_cuda_runtime_torch_brought_becomes_a_toolkit_cmake_finds_without_nvcc(tmp_path):
    site = tmp_path / "site"
    fake_torch(site, "12.8")
    result = run(tmp_path, f"torch_cuda_runtime {tmp_path / 'runtime'}", PY="python3", PYTHONPATH=str(site),
                 TORCH_VERSION="2.10.0+cu128", TORCH_CUDA="12.8")
    root = tmp_path / "runtime"
    assert (result.returncode, result.stdout.strip()) == (0, str(root)), result.stderr
    # What CMake's FindCUDAToolkit reads without nvcc: version.txt, include/cuda_runtime.h, lib64/libcudart.so.
    assert (root / "version.txt").read_text().strip() == "CUDA Version 12.8.0"
    assert (root / "include" / "cuda_runtime.h").resolve() == site / "nvidia" / "cuda_runtime" / "include" / "cuda_runtime.h"
    assert (root / "lib64" / "libcudart.so").resolve() == site / "nvidia" / "cuda_runtime" / "lib" / "libcudart.so.12"


def test_a_cuda_torch_without_its_runtime_headers_is_refused_with_what_to_load(tmp_path):
    site = tmp_path / "site"
    fake_torch(site, "12.8", runtime_files=("lib/libcudart.so.12",))  # no headers: not enough to build
    result = run(tmp_path, f"torch_cuda_runtime {tmp_path / 'runtime'}", PY="python3", PYTHONPATH=str(site),
                 TORCH_VERSION="2.10.0+cu128", TORCH_CUDA="12.8")
    assert result.returncode == 1 and "Load a CUDA 12 toolkit" in result.stderr


def test_cmake_is_shown_no_nvcc(tmp_path, toolkit):
    _, wrappers = toolkit
    others = [tmp_path / "a", tmp_path / "b"]
    result = run(wrappers, "path_without_nvcc", PATH=f"{wrappers}:{others[0]}:{wrappers}:{others[1]}")
    assert result.stdout.strip() == f"{others[0]}:{others[1]}"


@pytest.mark.parametrize("linked, refused", [(b"libcudart.so.12", False), (b"libcudart.so.13", True), (b"", False)])
def test_a_built_wheel_linking_another_cuda_majors_runtime_is_refused(tmp_path, linked, refused):
    """The names a library links sit in its string table: a libcudart.so.13 beside torch's CUDA 12 runtime
    is what a toolkit of the other major, found by CMake, leaves behind."""
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("horovod/torch/mpi_lib_v2.cpython-311-x86_64-linux-gnu.so", b"\x7fELF\0libmpi.so.40\0" + linked)
        archive.writestr("horovod/common/util.py", "libcudart.so.13 in a comment is not linked")
    result = run(tmp_path, f"check_cudart_major {wheel}", PY="python3", TORCH_VERSION="2.10.0+cu128", TORCH_CUDA="12.8")
    if refused:
        assert result.returncode == 1
        assert "links libcudart.so.13, but torch 2.10.0+cu128 is built for CUDA 12.8" in result.stderr
    else:
        assert result.returncode == 0, result.stderr

#!/usr/bin/env bash
# Sets up everything hvdtrain needs, from nothing, and is fast the second time.
#
#   system packages (Open MPI, cmake, a C++ compiler,  -> apt-get when root, else the exact command
#     fuse3 for the tests' hung mount)
#                                                         (without root: the MPI first on PATH, e.g. a
#                                                         site's `module load openmpi`; compilers only
#                                                         when Horovod must be built here)
#   a virtual environment in .venv                     -> VENV=... to choose another place
#   torch                                              -> an importable torch is reused; else TORCH_SPEC
#   Horovod 0.28.1 from its sdist, patched: C++17      -> wheel kept in $WHEELHOUSE/<key>/ (default
#                                                         .cache/wheels; a shared directory lets every
#                                                         node install the one build; HOROVOD_BUILD=never
#                                                         refuses to build, e.g. on compute nodes;
#                                                         set-ups sharing it build once: a lock)
#     (its torch binding C++20 when torch's headers need it),
#     no -g, and with NCCL a libnccl.so link              (NCCL when torch is a CUDA build and nvcc is here;
#                                                         the toolkit must be of torch's CUDA major;
#                                                         HOROVOD_NCCL=0: without NCCL, against the CUDA
#                                                         runtime torch brings, whatever toolkit is here)
#   mpi4py (loads the system MPI), hvdtrain           -> pip install -e .[test,examples]
#                                                         (HVDTRAIN_EXTRAS=..., EDITABLE=0: a plain install)
#   horovodrun --check-build                           -> fails unless PyTorch, MPI and Gloo are built
#                                                         (and NCCL, when it was built with NCCL)
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
# The newest torch that passes the suite (docs/reference/torch-versions.md). PyPI's 2.14.1 is a CUDA 13.0
# build: with nvcc here, Horovod is built with NCCL. torch==2.13.0 is this machine kind's local CPU wheel
# (1 GB instead of 5.5 GB in a venv, and no NCCL build).
TORCH_SPEC=${TORCH_SPEC:-torch==2.14.1}
HOROVOD_VERSION=0.28.1
CACHE=$ROOT/.cache
# Built Horovod wheels, one subdirectory per Python, torch and CUDA: on a cluster a directory on the
# storage every node reads, so that one node builds and the others install that wheel.
WHEELHOUSE=${WHEELHOUSE:-$CACHE/wheels}
# auto: build when the wheelhouse has no wheel for this Python and torch; never: refuse (compute nodes
# without compilers, or a job that must not spend minutes compiling).
HOROVOD_BUILD=${HOROVOD_BUILD:-auto}
# Seconds a set-up waits for the wheel another one is building into the same WHEELHOUSE (build_once).
HOROVOD_BUILD_WAIT=${HOROVOD_BUILD_WAIT:-1800}
# NCCL in Horovod, for a CUDA build of torch. auto: built when a CUDA toolkit of torch's major is here,
# left out (said so) when there is no toolkit at all; 1: required; 0: left out, and Horovod is built
# against the CUDA runtime torch brought (its nvidia wheel), not a toolkit of another major. Without
# NCCL, Horovod moves GPU tensors through host memory and MPI: correct, slower.
HOROVOD_NCCL=${HOROVOD_NCCL:-auto}
HVDTRAIN_EXTRAS=${HVDTRAIN_EXTRAS:-test,examples}
EDITABLE=${EDITABLE:-1}

say() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }
# Never stop without saying where: set -e alone exits silently.
trap 'die "line $LINENO failed (exit $?): $BASH_COMMAND"' ERR
# The content of a stamp file, or nothing when there is none yet (without tripping the trap).
stamp() { if [ -f "$1" ]; then cat "$1"; fi; }

check_settings() {
  case "$HOROVOD_BUILD" in auto|never) ;; *) die "HOROVOD_BUILD=$HOROVOD_BUILD: use auto (build when the wheelhouse has no wheel) or never";; esac
  case "$EDITABLE" in 0|1) ;; *) die "EDITABLE=$EDITABLE: use 1 (pip install -e, the default) or 0 (a plain install)";; esac
  case "$HOROVOD_NCCL" in auto|0|1) ;; *) die "HOROVOD_NCCL=$HOROVOD_NCCL: use auto (NCCL when a CUDA toolkit of torch's major is here), 1 (required) or 0 (without NCCL)";; esac
}

# What Horovod's build needs beyond MPI; without root these may be missing as long as no build runs.
BUILD_TOOLS_MISSING=()

install_system_packages() {
  local missing=() build_tools=()
  command -v mpirun >/dev/null || missing+=(openmpi-bin)
  command -v mpicxx >/dev/null || build_tools+=(libopenmpi-dev)
  command -v cmake  >/dev/null || build_tools+=(cmake)
  command -v g++    >/dev/null || build_tools+=(g++)
  command -v make   >/dev/null || build_tools+=(make)
  missing+=("${build_tools[@]}")
  # libfuse3 (with fusermount3), through which tests/faults' hung mount serves its FUSE file system.
  # Only tests use it, as root, and skip without it: without root it is never a reason to stop.
  if [ "$(id -u)" -eq 0 ]; then
    command -v fusermount3 >/dev/null || missing+=(fuse3)
  fi
  if [ ${#missing[@]} -gt 0 ]; then
    local cmd="apt-get install -y --no-install-recommends ${missing[*]}"
    if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
      say "installing system packages: ${missing[*]}"
      DEBIAN_FRONTEND=noninteractive apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $cmd -qq >/dev/null
    elif ! command -v mpirun >/dev/null; then
      die "no mpirun on PATH. On a cluster, load the site's MPI first (e.g. module load openmpi);" \
          "on your own machine: sudo apt-get update && sudo $cmd"
    else
      BUILD_TOOLS_MISSING=("${build_tools[@]}")
    fi
  fi
  # sed, not head: head's early exit would end mpirun with SIGPIPE, which pipefail reports
  say "MPI: $(command -v mpirun) ($(mpirun --version 2>&1 | sed -n 1p))"
}

make_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    local site=()
    # Reuse a torch that is already installed (often a site-wide CUDA build on clusters).
    if "$PYTHON" -c 'import torch' 2>/dev/null; then site=(--system-site-packages); fi
    say "creating virtual environment $VENV ${site[*]}"
    "$PYTHON" -m venv "${site[@]}" "$VENV"
  fi
  PY=$VENV/bin/python
  PIP=(pip_quiet install)
}

# Some pip configurations list local index folders that lack most packages; pip warns once per
# package about each. Those lines say nothing about this install: drop them, keep everything else.
pip_quiet() {
  "$PY" -m pip "$1" -q --disable-pip-version-check "${@:2}" \
    2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2 || true)
}

install_torch() {
  if ! "$PY" -c 'import torch' 2>/dev/null; then
    say "installing $TORCH_SPEC"
    "${PIP[@]}" "$TORCH_SPEC" numpy
  fi
  read -r TORCH_VERSION TORCH_CUDA < <("$PY" -W ignore -c 'import torch; print(torch.__version__, torch.version.cuda or "none")')
  # Checkpoints are read with torch.load(weights_only=True), which runs no pickled code only from 2.6 on.
  if ! "$PY" -W ignore -c 'import sys, torch; sys.exit(tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 6))'; then
    die "torch $TORCH_VERSION is installed, hvdtrain needs torch >= 2.6: older torch.load(weights_only=True)" \
        "can run code hidden in a checkpoint (CVE-2025-32434). Upgrade it (pip install 'torch>=2.6'), or set" \
        "up with a Python without it (PYTHON=/path/to/python make setup)"
  fi
  # NCCL support needs a CUDA build of torch and the CUDA toolkit, not a visible GPU: a login
  # node without GPUs builds the same wheel as the compute nodes.
  HAS_CUDA=0
  if want_nccl "$TORCH_CUDA"; then HAS_CUDA=1; fi
  if [ "$TORCH_CUDA" != none ] && [ "$HAS_CUDA" = 0 ]; then
    say "torch $TORCH_VERSION is a CUDA build; Horovod gets no NCCL ($WITHOUT_NCCL_REASON): on GPUs it would" \
        "move tensors through host memory and MPI. For NCCL: a CUDA ${TORCH_CUDA%%.*} toolkit on PATH or in CUDA_HOME"
  fi
}

# Whether Horovod gets NCCL, for a torch built for CUDA $1 ("none": a CPU build); when not, why
# (WITHOUT_NCCL_REASON).
want_nccl() {
  local cuda=$1 toolkit toolkit_cuda
  [ "$cuda" != none ] || return 1
  if [ "$HOROVOD_NCCL" = 0 ]; then WITHOUT_NCCL_REASON="HOROVOD_NCCL=0"; return 1; fi
  if ! { { [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; } || command -v nvcc >/dev/null; }; then
    [ "$HOROVOD_NCCL" = auto ] || die "HOROVOD_NCCL=1, but there is no nvcc on PATH or in CUDA_HOME: load a" \
      "CUDA ${cuda%%.*} toolkit (e.g. module load cuda) or set CUDA_HOME to one"
    WITHOUT_NCCL_REASON="no CUDA toolkit here"
    return 1
  fi
  toolkit=$(cuda_toolkit_root) || exit 1
  toolkit_cuda=$("$toolkit/bin/nvcc" --version | sed -n 's/.*release \([0-9.]*\),.*/\1/p')
  # Horovod's binding for a CUDA torch links the toolkit's libcudart.so.<major> (with NCCL or not);
  # torch's wheels bring only their own major's, so a node without the toolkit could not import it.
  [ "${toolkit_cuda%%.*}" = "${cuda%%.*}" ] || die "torch ${TORCH_VERSION:-} is built for CUDA $cuda," \
    "but the CUDA toolkit here ($toolkit) is CUDA $toolkit_cuda: Horovod's torch binding must be built" \
    "with a CUDA ${cuda%%.*} toolkit. Set CUDA_HOME to one, choose a torch built for CUDA" \
    "${toolkit_cuda%%.*} (TORCH_SPEC), or build Horovod without NCCL against torch's own CUDA runtime" \
    "(HOROVOD_NCCL=0; GPU tensors then move through host memory)"
}

# A CUDA "toolkit" of the runtime alone, in directory $1, made of the nvidia-cuda-runtime wheel a
# PyPI CUDA torch depends on: its headers, libcudart.so (a link to the wheel's libcudart.so.<major>)
# and the version file CMake's FindCUDAToolkit reads when there is no nvcc. Enough for Horovod's
# torch binding without NCCL, which compiles no CUDA code.
torch_cuda_runtime() {
  local root=$1 found
  found=$("$PY" -W ignore -c '
import glob, os, torch
major = torch.version.cuda.split(".")[0]
site = os.path.dirname(os.path.dirname(torch.__file__))
for lib in sorted(glob.glob(os.path.join(site, "nvidia", "**", f"libcudart.so.{major}"), recursive=True)):
    include = os.path.join(os.path.dirname(os.path.dirname(lib)), "include")
    if os.path.isfile(os.path.join(include, "cuda_runtime.h")):
        print(lib, include)
        break
')
  [ -n "$found" ] || die "torch $TORCH_VERSION is a CUDA $TORCH_CUDA build: Horovod's torch binding needs" \
    "CUDA's runtime headers and libcudart to build, and neither a CUDA ${TORCH_CUDA%%.*} toolkit nor torch's" \
    "nvidia-cuda-runtime wheel (with include/cuda_runtime.h) is here. Load a CUDA ${TORCH_CUDA%%.*} toolkit" \
    "(e.g. module load cuda) or set CUDA_HOME to one"
  mkdir -p "$root/lib64"
  ln -sf "${found%% *}" "$root/lib64/libcudart.so"
  ln -sfn "${found#* }" "$root/include"
  echo "CUDA Version $TORCH_CUDA.0" > "$root/version.txt"
  echo "$root"
}

# PATH without the directories that hold an nvcc: CMake would take that toolkit's CUDA over the one
# it is given.
path_without_nvcc() {
  local dir dirs kept=()
  IFS=: read -ra dirs <<<"$PATH"
  for dir in "${dirs[@]}"; do [ -x "$dir/nvcc" ] || kept+=("$dir"); done
  (IFS=:; echo "${kept[*]}")
}

# The CUDA toolkit's root: CUDA_HOME when it holds nvcc, else where nvcc itself says it lives
# (nvcc may be a wrapper script elsewhere on PATH).
cuda_toolkit_root() {
  local root=${CUDA_HOME:-}
  if [ -z "$root" ] || [ ! -x "$root/bin/nvcc" ]; then
    root=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ _HERE_=//p' | head -n 1)
    root=${root%/bin}
  fi
  [ -n "$root" ] && [ -f "$root/include/cuda_runtime.h" ] \
    || die "cannot find the CUDA toolkit of $(command -v nvcc) (no include/cuda_runtime.h under '${root}'):" \
           "set CUDA_HOME to the toolkit's directory (the one holding bin/nvcc and include/)"
  echo "$root"
}

# The wheel depends on the exact torch ABI and Python: both are in the cache key.
horovod_wheel_dir() {
  local py_tag
  py_tag=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  echo "$WHEELHOUSE/horovod-$HOROVOD_VERSION-$py_tag-torch-$TORCH_VERSION-cuda$HAS_CUDA"
}

build_horovod_wheel() {
  # A build directory per wheel and set-up: set-ups for two torch versions at once must not share one,
  # nor two set-ups of one wheel that both think they hold its lock (build_once). Without
  # the '+' of a local version (2.14.1+cu130): Horovod's setup.py then packed its library under the
  # build directory's own path inside the wheel, and horovod.torch imported without it.
  local out=$1 work
  [ "$HOROVOD_BUILD" = never ] && die "no Horovod wheel in $out and HOROVOD_BUILD=never: build it once," \
    "with this Python and torch, on a node with compilers: WHEELHOUSE=$WHEELHOUSE bash scripts/setup.sh"
  [ ${#BUILD_TOOLS_MISSING[@]} -eq 0 ] || die "Horovod must be built here (no wheel in $out), which needs" \
    "${BUILD_TOOLS_MISSING[*]} (mpicxx, cmake, g++, make). Load them (e.g. module load gcc cmake), or build on" \
    "a node that has them into the same WHEELHOUSE and run this again"
  work=$CACHE/build/$(basename "$1" | tr '+' '_').$$
  say "building Horovod $HOROVOD_VERSION against torch $TORCH_VERSION (about 4 minutes on 2 cores; 7 with NCCL's CUDA code)"
  rm -rf "$work" && mkdir -p "$work"
  pip_quiet download --no-binary :all: --no-deps "horovod==$HOROVOD_VERSION" -d "$work"
  tar -xzf "$work"/horovod-$HOROVOD_VERSION.tar.gz -C "$work"
  local src=$work/horovod-$HOROVOD_VERSION
  # 0.28.1 compiles with C++14; torch >= 2.1 headers need C++17 (upstream PR #3998, in no release).
  local f
  for f in "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"; do
    grep -q 'set(CMAKE_CXX_STANDARD 14)' "$f" || die "C++17 patch does not apply to $f: the sdist changed"
    sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' "$f"
  done
  # torch >= 2.14's headers need C++20 ("#error C++20 or later compatible compiler is required to
  # use ATen"): its binding then compiles as C++20, the rest of Horovod stays at C++17.
  local aten
  aten=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "ATen.h"))')
  if grep -q 'C++20 or later' "$aten"; then
    sed -i 's/set(CMAKE_CXX_STANDARD 17)/set(CMAKE_CXX_STANDARD 20)/' "$src/horovod/torch/CMakeLists.txt"
  fi
  # Horovod builds RelWithDebInfo (-O3 -g); nobody here reads its debug symbols, and writing them
  # costs compile time and wheel size: keep its -O3, drop -g (after its own flag edits).
  local lang
  for lang in C CXX; do
    local edit="string(REPLACE \"-O2\" \"-O3\" CMAKE_${lang}_FLAGS_RELWITHDEBINFO"
    grep -qF "$edit" "$src/CMakeLists.txt" || die "no-debug-info patch does not apply: the sdist changed"
    sed -i "/$edit/a string(REPLACE \"-g\" \"\" CMAKE_${lang}_FLAGS_RELWITHDEBINFO \"\${CMAKE_${lang}_FLAGS_RELWITHDEBINFO}\")" \
      "$src/CMakeLists.txt"
  done
  local gpu=() hide=()
  if [ "$HAS_CUDA" = 1 ]; then
    local toolkit
    toolkit=$(cuda_toolkit_root) || exit 1
    # CMake's FindCUDAToolkit looks for cudart beside the nvcc it runs; a wrapper script on PATH
    # (/usr/local/bin/nvcc exec'ing the real one) hid it: "Could NOT find CUDAToolkit (missing:
    # CUDAToolkit_INCLUDE_DIR CUDA_CUDART)". Name the toolkit and put its own nvcc first.
    gpu=(HOROVOD_GPU_OPERATIONS=NCCL CUDA_HOME="$toolkit" CUDAToolkit_ROOT="$toolkit" PATH="$toolkit/bin:$PATH")
    # PyPI's CUDA torch brings NCCL as the nvidia-nccl wheel: point Horovod's build at it
    # (a system NCCL is found without help). Built here against torch 2.13.0+cu130 and
    # nvidia-nccl-cu13 (scripts/build_nccl_check.sh); no GPU here to run it.
    local nccl
    nccl=$("$PY" -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])' 2>/dev/null || true)
    if [ -n "$nccl" ] && [ -d "$nccl/include" ]; then
      # The wheel ships only libnccl.so.2, no libnccl.so: Horovod's FindNCCL (find_library(nccl))
      # misses it ("Could NOT find NCCL (missing: NCCL_LIBRARY)"). A build-time link named
      # libnccl.so is enough: the linker records the soname libnccl.so.2, which torch has loaded
      # by the time horovod.torch is imported.
      local nccl_lib=$work/nccl-lib
      mkdir -p "$nccl_lib"
      local shared=$nccl/lib/libnccl.so.2
      [ -e "$shared" ] || shared=$nccl/lib/libnccl.so
      [ -e "$shared" ] || die "the nvidia-nccl wheel at $nccl has no lib/libnccl.so.2: its layout changed"
      ln -sf "$shared" "$nccl_lib/libnccl.so"
      gpu+=(HOROVOD_NCCL_INCLUDE="$nccl/include" HOROVOD_NCCL_LIB="$nccl_lib" HOROVOD_NCCL_LINK=SHARED)
    fi
  elif [ "$TORCH_CUDA" != none ]; then
    # Horovod's CMake adds CUDA to the binding of any CUDA torch (add_cuda: libcudart), NCCL or not,
    # and links torch's CUDA extension libraries, which cpp_extension finds under CUDA_HOME (else
    # beside an nvcc, else /usr/local/cuda). Without a toolkit of torch's major, both get torch's own
    # runtime, and no other CUDA in sight: an nvcc on PATH, CUDA_PATH or CUDACXX would make CMake
    # take that toolkit's libcudart instead.
    local runtime
    runtime=$(torch_cuda_runtime "$work/cuda-runtime") || exit 1
    hide=(-u CUDA_PATH -u CUDACXX -u HOROVOD_CUDA_HOME)
    gpu=(CUDA_HOME="$runtime" CUDAToolkit_ROOT="$runtime" HOROVOD_WITHOUT_NVTX=1 PATH="$(path_without_nvcc)")
  fi
  mkdir -p "$out"
  env "${hide[@]}" HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
      HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
      MAKEFLAGS="-j$(nproc)" "${gpu[@]}" \
      "$PY" -m pip wheel -q --no-build-isolation --no-deps "$src" -w "$out.tmp.$$" \
      > "$work/build.log" 2>&1 || die "Horovod build failed; see $work/build.log"
  check_cudart_major "$out.tmp.$$"/horovod-*.whl
  # The wheel appears in the wheelhouse in one rename: a node installing from it never reads half a wheel.
  mv "$out.tmp.$$"/horovod-*.whl "$out"/ && rm -rf "$out.tmp.$$" "$work"
}

# Horovod's libraries in wheel $1 link no libcudart but torch's CUDA major's: one of another major
# imports only where that toolkit is installed, and its CUDA calls would meet a second runtime.
check_cudart_major() {
  local linked
  linked=$("$PY" -c '
import re, sys, zipfile
wheel = zipfile.ZipFile(sys.argv[1])
print(" ".join(sorted({m.decode() for n in wheel.namelist() if n.endswith(".so")
                       for m in re.findall(rb"libcudart\.so\.[0-9]+", wheel.read(n))})))' "$1")
  local name
  for name in $linked; do
    [ "$name" = "libcudart.so.${TORCH_CUDA%%.*}" ] || die "the Horovod build links $name, but torch $TORCH_VERSION" \
      "is built for CUDA $TORCH_CUDA: a CUDA toolkit of another major was found. Set CUDA_HOME to a CUDA" \
      "${TORCH_CUDA%%.*} toolkit, or HOROVOD_NCCL=0 to build against torch's own CUDA runtime"
  done
}

# The wheel of a wheel directory, or nothing (without tripping the trap).
wheel_of() { ls "$1"/horovod-*.whl 2>/dev/null | head -n 1 || true; }

# Set-ups on several nodes that share a WHEELHOUSE (a job's first step on every node, say) may all
# find no wheel: one builds, the others wait for its wheel instead of building into the same
# directories. The lock is a directory made by mkdir, atomic on NFS and Lustre, where flock may not
# work; it names its holder, and a holder on this host that no longer runs (killed mid-build) leaves
# a lock the next set-up takes over. A holder elsewhere is waited for up to HOROVOD_BUILD_WAIT seconds.
build_once() {
  local dir=$1 lock=$1.lock waited=0 owner
  mkdir -p "$(dirname "$lock")"
  until mkdir "$lock" 2>/dev/null; do
    [ -n "$(wheel_of "$dir")" ] && return 0  # the holder's wheel is there
    owner=$(stamp "$lock/owner")
    if lock_holder_gone "$owner"; then
      say "taking over the Horovod build lock of a set-up that no longer runs ($owner)"
      rm -rf "$lock"
      continue
    fi
    [ "$waited" -eq 0 ] && say "waiting for the Horovod wheel that ${owner:-another set-up} is building into $dir" \
      "(lock $lock; up to ${HOROVOD_BUILD_WAIT:-1800} s)"
    [ "$waited" -ge "${HOROVOD_BUILD_WAIT:-1800}" ] && die "no Horovod wheel in $dir after $waited s of waiting" \
      "for ${owner:-another set-up} (lock $lock). If no set-up is building it, remove $lock and run this again"
    sleep 2
    waited=$((waited + 2))
  done
  echo "host $(uname -n) pid $$ since $(date -u +%FT%TZ)" > "$lock/owner"
  trap "rm -rf '$lock'" EXIT  # a failed build (die) lets go of it too
  [ -n "$(wheel_of "$dir")" ] || build_horovod_wheel "$dir"  # unless built between the look and the lock
  rm -rf "$lock"
  trap - EXIT
}

# A lock's owner line ("host H pid P since T") names a process of this host that no longer runs.
lock_holder_gone() {
  local host pid
  read -r _ host _ pid _ <<< "$1"
  [ -n "$pid" ] && [ "$host" = "$(uname -n)" ] && ! kill -0 "$pid" 2>/dev/null
}

install_horovod() {
  local dir wheel
  dir=$(horovod_wheel_dir)
  wheel=$(wheel_of "$dir")  # none yet on a new machine
  # Installed from this very wheel already: nothing to do (the fast path of a second run). Its
  # checksum too: a wheel built again at the same path (another build of that torch) is installed.
  [ -n "$wheel" ] && [ "$(stamp "$VENV/.horovod-wheel")" = "$(wheel_id "$wheel")" ] && return 0
  # Horovod's runtime deps, and what its build needs from the environment (no build isolation).
  "${PIP[@]}" cloudpickle psutil pyyaml packaging cffi wheel setuptools
  if [ -z "$wheel" ]; then
    build_once "$dir"
    wheel=$(ls "$dir"/horovod-*.whl | head -n 1)
  fi
  # pip would keep an installed 0.28.1 built against another torch: reinstall when the wheel differs.
  say "installing $(basename "$wheel")"
  "${PIP[@]}" --force-reinstall --no-deps "$wheel"
  wheel_id "$wheel" > "$VENV/.horovod-wheel"
}

wheel_id() { echo "$1 $(sha256sum < "$1" | cut -d' ' -f1)"; }

install_hvdtrain() {
  local stamp_file=$VENV/.hvdtrain-deps key
  # A plain install copies the package: its sources are part of the key (an editable one reads them in place).
  key=$({ cat "$ROOT/setup.cfg" "$ROOT/scripts/setup.sh"; echo "$HVDTRAIN_EXTRAS $EDITABLE"
          [ "$EDITABLE" = 1 ] || find "$ROOT/hvdtrain" -name '*.py' -print0 | sort -z | xargs -0 cat
        } | sha256sum | cut -d' ' -f1)
  [ "$(stamp "$stamp_file")" = "$key" ] && return 0
  say "installing mpi4py and hvdtrain"
  # mpi4py >= 4.1 wheels carry no MPI: they load the system's libmpi (Open MPI or MPICH ABI) at
  # import, so no compile is needed (building it from source took 2-4 minutes of one core).
  # verify_mpi4py checks that the library it loads is the one mpirun belongs to.
  "${PIP[@]}" "mpi4py>=4.1"
  local target=$ROOT editable=()
  [ -n "$HVDTRAIN_EXTRAS" ] && target="$ROOT[$HVDTRAIN_EXTRAS]"
  [ "$EDITABLE" = 1 ] && editable=(-e)
  "${PIP[@]}" "${editable[@]}" "$target"
  echo "$key" > "$stamp_file"
}

verify_horovod() {
  local installed verified=$VENV/.horovod-verified
  installed=$(cat "$VENV/.horovod-wheel")
  if [ "$(stamp "$verified")" = "$installed" ]; then
    # Verified when installed; since then a quick import says it still loads (check-build takes 5-10 s).
    "$PY" -W ignore -c 'import horovod.torch as hvd; assert hvd.mpi_built() and hvd.gloo_built()' \
      || die "Horovod no longer imports with MPI and Gloo: rm $verified and run this script again"
  else
    local report need needed=(PyTorch MPI Gloo)
    # A CUDA torch with nvcc builds NCCL in: a wheel without it would run the GPUs' all-reduce over MPI.
    [ "$HAS_CUDA" = 1 ] && needed+=(NCCL)
    report=$("$VENV/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $report"
    for need in "${needed[@]}"; do
      grep -Eq "\[X\] $need\b" <<<"$report" || die "Horovod was built without $need support:
$report
Remove $(horovod_wheel_dir) and run this script again; the build log shows why $need was left out."
    done
    echo "$installed" > "$verified"
  fi
  local built="PyTorch, MPI and Gloo"
  [ "$HAS_CUDA" = 1 ] && built="PyTorch, MPI, Gloo and NCCL"
  local without=""
  [ "$HAS_CUDA" = 0 ] && [ "$TORCH_CUDA" != none ] && without=", no NCCL ($WITHOUT_NCCL_REASON)"
  say "Horovod $HOROVOD_VERSION ready: $built built$without ($VENV)"
}

verify_mpi4py() {
  # mpi4py's wheel loads whichever libmpi the loader finds: it must be the MPI of this mpirun.
  local library launcher
  library=$("$PY" -c 'from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), "").splitlines()[0])' 2>&1) \
    || die "mpi4py cannot load an MPI library: $library"
  launcher=$(mpirun --version 2>&1 | head -n 1)
  [[ "$library" == *"${launcher##* }"* ]] || die "mpi4py loads '$library' but mpirun is '$launcher':
put the MPI that mpirun belongs to first in LD_LIBRARY_PATH, or build mpi4py against it:
  $PY -m pip install --force-reinstall --no-binary mpi4py mpi4py"
}

# Each step's wall time, and the total, so a slow fresh set-up shows where its time goes.
SETUP_START=$SECONDS
STEP_TIMES=()
step() {
  local name=$1 start=$SECONDS; shift
  "$@"
  STEP_TIMES+=("$(printf '%-24s %4ds' "$name" $((SECONDS - start)))")
}

check_settings
step "system packages (apt)" install_system_packages
step "virtual environment" make_venv
step "torch" install_torch
step "Horovod (build/install)" install_horovod
step "mpi4py + hvdtrain" install_hvdtrain
step "check" verify_horovod
step "check mpi4py" verify_mpi4py
say "step times:"
for line in "${STEP_TIMES[@]}"; do say "  $line"; done
say "  $(printf '%-24s %4ds' total $((SECONDS - SETUP_START)))"

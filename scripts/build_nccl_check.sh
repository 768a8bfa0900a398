#!/usr/bin/env bash
# Proves the NCCL build path of scripts/setup.sh on a machine with the CUDA toolkit but no GPU:
# a separate virtual environment with PyPI's CUDA build of torch (and the nvidia-* NCCL wheel it
# brings), Horovod 0.28.1 built by setup.sh itself with HOROVOD_GPU_OPERATIONS=NCCL, then
# `horovodrun --check-build` must list NCCL and `import horovod.torch` must work.
#
# Too slow for CI (several GB of CUDA wheels, then a CUDA compile on 2 cores): a session runs it by
# hand. It never touches the project's .venv.
#
#   VENV=/tmp/gpu-venv  CUDA_HOME=/usr/local/cuda  TORCH_SPEC=torch==2.13.0  scripts/build_nccl_check.sh
set -Eeuo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-/tmp/gpu-venv}
CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

say() { printf '[nccl-check] %s\n' "$*"; }
die() { printf '[nccl-check] ERROR: %s\n' "$*" >&2; exit 1; }

[ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc in $CUDA_HOME/bin: set CUDA_HOME to the CUDA toolkit"
case "$VENV" in "$ROOT/.venv"|"$ROOT/.venv/") die "VENV=$VENV is the project's own environment: choose another";; esac

# This machine's pip configuration adds a local folder holding torch's CPU wheel (torch-X+cpu sorts
# above torch-X, so pip would pick it): ignore every pip config file and ask PyPI alone, which
# serves the CUDA build under the plain version.
start=$SECONDS
say "setup.sh with VENV=$VENV TORCH_SPEC=$TORCH_SPEC, nvcc from $CUDA_HOME (niced)"
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null PIP_INDEX_URL=https://pypi.org/simple \
    PATH="$CUDA_HOME/bin:$PATH" CUDA_HOME="$CUDA_HOME" VENV="$VENV" TORCH_SPEC="$TORCH_SPEC" \
    nice -n 19 bash "$ROOT/scripts/setup.sh"

cuda=$("$VENV/bin/python" -W ignore -c 'import torch; print(torch.version.cuda or "")')
[ -n "$cuda" ] || die "torch in $VENV is a CPU build: the NCCL path was not taken"
report=$("$VENV/bin/horovodrun" --check-build 2>&1) || die "horovodrun --check-build failed: $report"
printf '%s\n' "$report"
grep -Eq '\[X\] NCCL\b' <<<"$report" || die "Horovod was built without NCCL (torch CUDA $cuda)"
"$VENV/bin/python" -W ignore -c 'import horovod.torch as hvd; assert hvd.nccl_built(), "nccl_built() is false"; print("import horovod.torch: ok, nccl_built:", hvd.nccl_built())'
say "NCCL build verified against torch CUDA $cuda in $((SECONDS - start))s"

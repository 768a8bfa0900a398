#!/usr/bin/env bash
# The documentation's environment: a venv with docs/requirements.txt only (no torch, no Horovod).
# Usage: docs_env.sh VENV PYTHON. Marks a complete install with VENV/.installed, so make re-runs
# this only when docs/requirements.txt changes.
set -euo pipefail
venv=$1 python=${2:-python3}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# docs/requirements.txt pins the newest releases that install on Python 3.10 and later.
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "docs_env: the docs' environment needs Python 3.10 or later; $python is $("$python" --version 2>&1)." >&2
  echo "Choose another: make docs PYTHON=/path/to/python3.11" >&2
  exit 2
fi
if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
  echo "docs_env: $python cannot create a virtual environment (no venv/ensurepip module)." >&2
  echo "Install it (Debian/Ubuntu: apt-get install python3-venv) or choose another: make docs PYTHON=/path/to/python3" >&2
  exit 2
fi
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
# Some pip configurations list local index folders that lack most packages; pip warns once per
# package about each: those lines say nothing about this install.
"$venv/bin/python" -m pip install -q --disable-pip-version-check -r "$root/docs/requirements.txt" \
  2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2 || true)
touch "$venv/.installed"

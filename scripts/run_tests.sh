#!/usr/bin/env bash
# The whole test suite, in four launches:
#   1. one process:               tests/unit (no MPI) and tests/launch (train.py under every launcher)
#   2. mpirun -np $NP:            tests/mpi, every test in every rank
#   3. horovodrun -np $NP --gloo: tests/mpi again, over Gloo instead of MPI
#   4. one process:               tests/cluster, two test hosts and a SLURM cluster built on this
#                                 machine (as root on Linux; skipped with the reason elsewhere)
# then one summary over all of them. Each launch has a hard time limit: nothing here can hang CI.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
NP=${NP:-2}
RESULTS=$ROOT/.cache/test-results
export PATH=$VENV/bin:$PATH
cd "$ROOT"
rm -rf "$RESULTS" && mkdir -p "$RESULTS"

if [ "$(id -u)" -eq 0 ]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
# A rank that stops calling collectives ends the job (MPI controller) instead of stalling it.
export HOROVOD_STALL_CHECK_TIME_SECONDS=10 HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=60

PYTEST="python -m pytest -q --color=no -p no:cacheprovider"
status=0
phase() {
  local title=$1; shift
  printf '\n===== %s =====\n' "$title"
  "$@" || status=1
}

phase "one process: tests/unit tests/launch" \
  timeout -k 10 1800 $PYTEST tests/unit tests/launch --junitxml="$RESULTS/single.xml"
# sh -c expands each rank's own rank variable into its result file name.
phase "mpirun -np $NP: tests/mpi" \
  timeout -k 10 900 mpirun -np "$NP" --oversubscribe \
  sh -c "exec $PYTEST --with-mpi tests/mpi --junitxml=$RESULTS/mpi-rank\$OMPI_COMM_WORLD_RANK.xml"
phase "horovodrun -np $NP --gloo: tests/mpi" \
  timeout -k 10 900 horovodrun -np "$NP" --gloo \
  sh -c "exec $PYTEST --with-mpi tests/mpi --junitxml=$RESULTS/gloo-rank\$HOROVOD_RANK.xml"
phase "two-host cluster: tests/cluster" \
  timeout -k 30 1800 $PYTEST -rs tests/cluster --junitxml="$RESULTS/cluster.xml"

printf '\n===== summary =====\n'
python "$ROOT/scripts/summarize_tests.py" "$RESULTS" --ranks "$NP" || status=1
exit $status

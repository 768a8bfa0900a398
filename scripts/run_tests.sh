#!/usr/bin/env bash
# The whole test suite, in these launches:
#   1. one process:               tests/unit (no MPI) and tests/launch (train.py under every launcher)
#   2. mpirun -np $NP:            tests/mpi, every test in every rank
#   3. horovodrun -np $NP --gloo: tests/mpi again, over Gloo instead of MPI, less the files marked
#                                 skip_gloo (nothing in them goes through the transport)
#   4. tests/mpi again at 1 rank (mpirun; marked np1) and at 4 ranks (mpirun, marked np4; horovodrun
#      --gloo, marked gloo_np4, in two launches: without and with a mesh's process sets): shards,
#      padding, Adasum's tree of ranks, the servers' slices and the mesh's layouts change with the
#      world size, so each is checked at 1, 2 and 4
#   5. one process:               tests/cluster, two test hosts and a SLURM cluster built on this
#                                 machine (as root on Linux; skipped with the reason elsewhere)
# then one summary over all of them. Each launch has a hard time limit: nothing here can hang CI.
# A tests/mpi file says which launches of 3 and 4 it belongs in, and why, by its markers (pytestmark,
# registered in setup.cfg); the launches select them with -m over the directory, not by file names.
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
# A torch thread with nothing to do sleeps instead of spinning (OpenMP's default spins ~300,000 times
# first): here every core is shared, by the two test files at a time and their launches, and the spin
# takes the core from the work it waits for. Only the waiting changes, never a result: the fine-tune
# example's epoch at torch's 2 threads on 2 loaded cores took 66 s of CPU spinning, 16 s sleeping
# (the same as 1 thread), to the same accuracy.
export OMP_WAIT_POLICY=PASSIVE

PYTEST="python -m pytest -q --color=no -p no:cacheprovider"
status=0
# phase KEY RANKS TITLE COMMAND...: RANKS 0 is one process writing KEY.xml; otherwise every rank
# writes KEY-rankR.xml. The summary reads the announced phases, so a launch that died is counted.
phase() {
  local key=$1 ranks=$2 title=$3; shift 3
  printf '%s\t%s\t%s\n' "$key" "$ranks" "$title" >> "$RESULTS/phases.tsv"
  printf '\n===== %s =====\n' "$title"
  "$@" || status=1
}
# sh -c expands each rank's own rank variable into its result file name; the arguments reach pytest
# as they are (a marker expression has spaces) through sh's "$@".
on_mpirun() {  # KEY NP LIMIT PYTEST-ARGUMENTS...
  local key=$1 np=$2 limit=$3; shift 3
  phase "$key" "$np" "mpirun -np $np: $*" timeout -k 10 "$limit" mpirun -np "$np" --oversubscribe \
    sh -c "exec \"\$@\" --junitxml=$RESULTS/$key-rank\$OMPI_COMM_WORLD_RANK.xml" sh $PYTEST --with-mpi "$@"
}
on_gloo() {  # KEY NP LIMIT PYTEST-ARGUMENTS...
  local key=$1 np=$2 limit=$3; shift 3
  # Gloo gives up on a peer after 30 s by default: 4 ranks on 2 loaded cores can wait longer than that
  # between a pipeline's exchanges, and the launch's own time limit still bounds the whole run.
  phase "$key" "$np" "horovodrun -np $np --gloo: $*" timeout -k 10 "$limit" horovodrun -np "$np" --gloo \
    --gloo-timeout-seconds 180 \
    sh -c "exec \"\$@\" --junitxml=$RESULTS/$key-rank\$HOROVOD_RANK.xml" sh $PYTEST --with-mpi "$@"
}

# The slowest tests are listed: the suite's time is a budget (CI's limit), spent where it proves most.
# Two files at a time (pytest-xdist; a file's tests stay together, so its module-wide runs are shared):
# a launch spends part of its time starting up or waiting for a stall or a checkpoint, not computing
# (834 s one file at a time, 686-695 s two at a time, on 2 AVX-512 cores; 1490 s on 2 AVX2 cores,
# hence a limit well above it).
phase single 0 "one process: tests/unit tests/launch" \
  timeout -k 10 2400 $PYTEST -n "${TEST_FILES_AT_ONCE:-2}" --dist loadfile --no-loadscope-reorder --durations=20 tests/unit tests/launch \
  --junitxml="$RESULTS/single.xml"
on_mpirun mpi "$NP" 900 tests/mpi
on_gloo gloo "$NP" 900 tests/mpi -m "not skip_gloo"
on_mpirun mpi-1 1 600 tests/mpi -m np1
on_mpirun mpi-4 4 900 tests/mpi -m np4
# Under Gloo, 4 ranks on 2 cores, Horovod's dynamic process sets double every collective's time:
# the tests that need no mesh run in a launch of their own, without them (tests/mpi/conftest.py).
on_gloo gloo-4 4 900 tests/mpi -m "gloo_np4 and not process_sets"
# Gloo's process sets at 4 ranks: the mesh machinery; the Hugging Face and meta-device mesh tests run these
# same paths at 4 ranks under MPI (marked np4, not gloo_np4).
on_gloo gloo-4-mesh 4 900 tests/mpi -m "gloo_np4 and process_sets"
phase cluster 0 "two-host cluster: tests/cluster" \
  timeout -k 30 1800 $PYTEST -rs tests/cluster --junitxml="$RESULTS/cluster.xml"

printf '\n===== summary =====\n'
python "$ROOT/scripts/summarize_tests.py" "$RESULTS" || status=1
exit $status

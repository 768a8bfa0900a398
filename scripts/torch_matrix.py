"""The suite's core against each supported torch version, one virtual environment per version.

For every version: scripts/setup.sh into .cache/venvs/torch-<version> (TORCH_SPEC=torch==<version>;
setup.sh caches the Horovod wheel per torch version, so a second run only checks), then the core:
tests/unit in one process and CORE_MPI under `mpirun -np 2`. Each version's result is kept in
.cache/torch-matrix/<version>/result.json: a run that stopped half-way resumes at the first version
without one (--rerun to run a version again). The markdown table of every result replaces the part of
the docs page between its markers; a version without a result is listed as not run, with the reason
given by --not-run, never guessed.

    python scripts/torch_matrix.py                          # DEFAULT_VERSIONS
    python scripts/torch_matrix.py --versions 2.14.1 2.13.0
    python scripts/torch_matrix.py --versions 2.6.0 --not-run 2.7.1="4 GB download each, not done here"
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

from summarize_tests import merge_ranks, outcomes

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / ".cache" / "torch-matrix"
VENVS = ROOT / ".cache" / "venvs"
PAGE = ROOT / "docs" / "reference" / "torch-versions.md"
START_MARK = "<!-- torch-matrix:start -->"
END_MARK = "<!-- torch-matrix:end -->"

# The newest release of each minor version from hvdtrain's floor (2.6: torch.load(weights_only=True)
# runs no pickled code before it, CVE-2025-32434) up to the newest pip installs here: `pip index
# versions torch` on 2026-11-27 listed 2.15.0 too, which this machine's pip constraint (torch<=2.14.1)
# refuses.
DEFAULT_VERSIONS = ("2.6.0", "2.7.1", "2.8.0", "2.9.1", "2.10.0", "2.11.0", "2.12.1", "2.13.0", "2.14.1")

# The core: every one-process unit test, then the 2-rank files that would catch a torch change in
# what hvdtrain computes or stores: N workers = one process under ddp, zero1, zero2 and fsdp
# (equivalence, replicas), checkpoints across strategies, sharded and resumed bitwise.
CORE_UNIT = ("tests/unit",)
CORE_MPI = (
    "tests/mpi/test_equivalence.py",
    "tests/mpi/test_replicas.py",
    "tests/mpi/test_strategies.py",
    "tests/mpi/test_sharded_checkpoint.py",
    "tests/mpi/test_resume.py",
)
# Limits well above what each took here (README of the page: the table's seconds); a CUDA build of
# torch downloads several GB and compiles Horovod's CUDA code, hence the long set-up limit.
SETUP_LIMIT_S = 3600
UNIT_LIMIT_S = 1800
MPI_LIMIT_S = 900

RUN_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # A rank that stops calling collectives ends the job instead of stalling it.
    "HOROVOD_STALL_CHECK_TIME_SECONDS": "10",
    "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60",
    "OMP_WAIT_POLICY": "PASSIVE",
}


def version_key(version: str) -> tuple:
    """2.10.0 sorts after 2.9.1; a local tag (+cpu) is ignored."""
    try:
        return tuple(int(part) for part in version.split("+")[0].split("."))
    except ValueError:
        raise ValueError(f"torch version {version!r} is not numbers and dots (e.g. 2.14.1)") from None


def run_logged(command: List[str], log: Path, limit_s: int, env: Dict[str, str]) -> int:
    """The command's exit status (124 when it ran past limit_s), its output appended to log."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        try:
            return subprocess.run(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=limit_s).returncode
        except subprocess.TimeoutExpired:
            out.write(f"timed out after {limit_s} s\n")
            return 124


def last_error(log: Path) -> str:
    """setup.sh's ERROR line, which says what failed and what to do, or the log's last line."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if "ERROR" in line]
    return (errors or lines or ["no output"])[-1].strip()


def count_core(directory: Path, unit_ranks: int, mpi_ranks: int) -> Dict[str, int]:
    """Passed/failed/skipped over the core's JUnit files; a test counts once, failed in any rank.
    A launch that left no result file (crashed, timed out) counts as one failure."""
    total = {"passed": 0, "failed": 0, "skipped": 0}
    launches = [[directory / "unit.xml"]] if unit_ranks else []
    launches.append([directory / f"mpi-rank{rank}.xml" for rank in range(mpi_ranks)])
    for files in launches:
        if not all(f.exists() for f in files):
            total["failed"] += 1
            continue
        counts = merge_ranks([outcomes(f) for f in files])
        for kind in total:
            total[kind] += counts[kind]
    return total


def cuda_mismatch(error: str) -> Optional[str]:
    """From set-up's refusal of a torch built for another CUDA major than the toolkit here, the two
    versions ("torch CUDA 12.8, toolkit here CUDA 13.0"); None for any other error."""
    found = re.search(r"is built for CUDA ([0-9.]+), but the CUDA toolkit here \(.*?\) is CUDA ([0-9.]+)", error)
    return f"torch CUDA {found[1]}, toolkit here CUDA {found[2]}" if found else None


def set_up(version: str, directory: Path, niceness: int) -> dict:
    venv = VENVS / f"torch-{version}"
    log = directory / "setup.log"
    # The base interpreter, not a virtual environment's: setup.sh would reuse that one's torch.
    python = os.environ.get("PYTHON") or str(Path(sys.base_prefix) / "bin" / "python3")
    env = {**os.environ, "VENV": str(venv), "TORCH_SPEC": f"torch=={version}", "PYTHON": python}
    command = ["nice", "-n", str(niceness), "bash", str(ROOT / "scripts" / "setup.sh")]
    start = time.monotonic()
    status = run_logged(command, log, SETUP_LIMIT_S, env)
    mismatch = cuda_mismatch(last_error(log)) if status != 0 else None
    if mismatch:
        # No GPU runs here, so NCCL is only built, never used: the core means the same without it.
        # Set-up builds Horovod against the CUDA runtime that torch brought instead.
        status = run_logged(command, log, SETUP_LIMIT_S, {**env, "HOROVOD_NCCL": "0"})
    # A wheel built before makes a set-up minutes shorter: the table says which it was.
    built = "building Horovod" in log.read_text(errors="replace")
    result = {"setup_s": round(time.monotonic() - start), "setup_ok": status == 0, "horovod_built": built}
    if mismatch:
        result["without_nccl"] = f"HOROVOD_NCCL=0: {mismatch}"
    if status != 0:
        result["note"] = last_error(log)
        return result
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-W", "ignore", "-c",
         "import torch, horovod.torch as hvd; print(torch.__version__, bool(hvd.nccl_built()))"],
        capture_output=True, text=True, timeout=300, check=True)
    torch_build, nccl = probe.stdout.split()
    result.update(torch=torch_build, nccl=nccl == "True")
    return result


def run_core(version: str, directory: Path) -> dict:
    venv = VENVS / f"torch-{version}"
    env = {**os.environ, **RUN_ENV, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    env.pop("PYTHONPATH", None)  # the venv's own packages and this checkout's hvdtrain only
    log = directory / "core.log"
    pytest = ["python", "-m", "pytest", "-q", "--color=no", "-p", "no:cacheprovider"]
    for stale in directory.glob("*.xml"):
        stale.unlink()
    start = time.monotonic()
    run_logged([*pytest, *CORE_UNIT, f"--junitxml={directory / 'unit.xml'}"], log, UNIT_LIMIT_S, env)
    # sh -c expands each rank's own rank into its result file's name.
    run_logged(["mpirun", "-np", "2", "--oversubscribe", "sh", "-c",
                f'exec "$@" --junitxml={directory}/mpi-rank$OMPI_COMM_WORLD_RANK.xml', "sh",
                *pytest, "--with-mpi", *CORE_MPI], log, MPI_LIMIT_S, env)
    return {"core_s": round(time.monotonic() - start), **count_core(directory, 1, 2)}


def run_version(version: str, niceness: int) -> dict:
    directory = RESULTS / version
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "setup.log").unlink(missing_ok=True)
    (directory / "core.log").unlink(missing_ok=True)
    print(f"[torch-matrix] {version}: set-up (log: {directory / 'setup.log'})", flush=True)
    result = {"version": version, "status": "run", **set_up(version, directory, niceness)}
    if result["setup_ok"]:
        print(f"[torch-matrix] {version}: core (log: {directory / 'core.log'})", flush=True)
        result.update(run_core(version, directory))
    save(result)
    return result


def save(result: dict) -> None:
    directory = RESULTS / result["version"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "result.json").write_text(json.dumps(result, indent=1) + "\n")


def load(version: str) -> Optional[dict]:
    path = RESULTS / version / "result.json"
    return json.loads(path.read_text()) if path.exists() else None


def table_row(version: str, result: Optional[dict]) -> str:
    if result is None:
        return f"| {version} | not run here: no result recorded | | | |"
    if result["status"] == "not run":
        return f"| {version} | not run here: {result['reason']} | | | |"
    build = result.get("torch", version)
    if result.get("nccl"):
        build += ", Horovod with NCCL"
    elif "+cu" in build:
        build += ", Horovod without NCCL" + (f" ({result['without_nccl']})" if "without_nccl" in result else "")
    if not result["setup_ok"]:
        return f"| {build} | failed, {result['setup_s']} s: {result['note']} | | | |"
    verdict = "passes" if result["failed"] == 0 and result["passed"] > 0 else "fails"
    wheel = "Horovod built" if result.get("horovod_built") else "Horovod wheel cached"
    return (f"| {build} | ok, {result['setup_s']} s ({wheel}) | {result['passed']} / {result['failed']} / "
            f"{result['skipped']} | {result['core_s']} s | {verdict} |")


def render_table(results: Dict[str, Optional[dict]]) -> str:
    lines = ["| torch | set-up (seconds) | core: passed / failed / skipped | core seconds | verdict |",
             "|---|---|---|---|---|"]
    lines += [table_row(version, results[version]) for version in sorted(results, key=version_key)]
    return "\n".join(lines)


def replace_table(page: Path, table: str) -> None:
    text = page.read_text()
    if text.count(START_MARK) != 1 or text.count(END_MARK) != 1 or text.index(START_MARK) > text.index(END_MARK):
        raise SystemExit(f"{page} needs one line {START_MARK} and, after it, one line {END_MARK}: "
                         "the table is written between them")
    head, rest = text.split(START_MARK)
    tail = rest.split(END_MARK)[1]
    page.write_text(f"{head}{START_MARK}\n{table}\n{END_MARK}{tail}")


def parse_not_run(items: List[str]) -> Dict[str, str]:
    reasons = {}
    for item in items:
        version, sep, reason = item.partition("=")
        if not sep or not reason.strip():
            raise SystemExit(f"--not-run {item!r}: write VERSION=REASON, e.g. --not-run 2.7.1='4 GB download'")
        version_key(version)
        reasons[version] = reason.strip()
    return reasons


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--versions", nargs="+", default=list(DEFAULT_VERSIONS),
                        help="torch versions to set up and test, in this order (default: %(default)s)")
    parser.add_argument("--rerun", action="store_true", help="run versions that already have a result again")
    parser.add_argument("--not-run", action="append", default=[], metavar="VERSION=REASON",
                        help="record why a version is not run here; it is listed with the reason")
    parser.add_argument("--nice", type=int, default=10, help="niceness of the set-up (others share the cores)")
    parser.add_argument("--page", type=Path, default=PAGE, help="the docs page whose table is rewritten")
    args = parser.parse_args(argv)
    for version in args.versions:
        version_key(version)

    failed = False
    for version, reason in parse_not_run(args.not_run).items():
        save({"version": version, "status": "not run", "reason": reason})
    for version in args.versions:
        previous = load(version)
        if previous and previous["status"] == "run" and not args.rerun:
            print(f"[torch-matrix] {version}: kept from {RESULTS / version / 'result.json'} (--rerun to run again)")
            continue
        result = run_version(version, args.nice)
        failed = failed or not result["setup_ok"] or result["failed"] > 0 or result["passed"] == 0
        print(f"[torch-matrix] {version}: {table_row(version, result)}", flush=True)

    shown = set(DEFAULT_VERSIONS) | set(args.versions) | {p.parent.name for p in RESULTS.glob("*/result.json")}
    table = render_table({version: load(version) for version in shown})
    replace_table(args.page, table)
    print(table)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""``hvdtrain doctor --gpu``: the GPU self-test of one node. Launches the worker
(hvdtrain.bench.gpu.worker) under mpirun with a rank per visible GPU on this host, twice: every
check with every rank seeing every GPU, then the pinning alone with each rank given one GPU. Judges
the figures with hvdtrain.launch.gpu_selftest: one table, PASS or FAIL, the exit code to match.

No torch here: whether a GPU is visible is read from nvidia-smi, so that a machine without one
answers at once (exit NO_GPU_EXIT) instead of starting a job.
"""
from __future__ import annotations

import socket
import sys
from typing import List, Optional, Sequence

from hvdtrain.bench.common import jobs
from hvdtrain.launch.doctor import FAIL, Row, render
from hvdtrain.launch.gpu_selftest import NO_GPU_EXIT, exit_code, gpus_here, no_gpu_message, rows_from_result, summary
from hvdtrain.launch.hostfile import Host

WORKER = "hvdtrain.bench.gpu.worker"
# Start-up, NCCL's first communicator, 3 sizes, 5 strategies, 2 meshes, 2 precisions on 2-8 GPUs:
# about a minute; a hang (a rank that cannot reach NCCL's peers) ends here. Each of the two jobs.
TIMEOUT = 900


def selftest(ranks: int, expect: str, link_gbps: Optional[float] = None, sizes: Optional[Sequence[int]] = None,
             iters: int = 10, timeout: float = TIMEOUT) -> List[Row]:
    """Run the worker with ``ranks`` ranks on this host and return its rows.

    Args:
        ranks: ranks to start on this host.
        expect: the device type every rank must compute on ("cuda" on a GPU node; "cpu" in the tests).
        link_gbps: the link's bandwidth in GB/s to judge the all-reduce against (None: not judged).
        sizes: the all-reduce sizes in bytes (None: the worker's).
        iters: timed all-reduce calls per size.
        timeout: seconds before the worker job is killed.
    """
    if ranks < 1:
        raise ValueError(f"the self-test needs at least one rank, got {ranks}")
    args = ["--iters", str(iters)]
    if sizes:
        args += ["--sizes", ",".join(str(size) for size in sizes)]
    def job(arguments: List[str]):
        return jobs.run_job(WORKER, arguments, np=ranks, launcher="mpirun", timeout=timeout,
                            hosts=[Host("localhost", ranks)])

    try:
        found = job(args)
    except jobs.JobFailed as error:
        return [Row("self-test job", f"{ranks} ranks", FAIL, str(error)[-1500:])]
    try:  # the other layout: each rank given one GPU (a job of its own: CUDA reads the variable once)
        found["one_gpu_per_rank"] = job(["--one-gpu-per-rank"])
    except jobs.JobFailed as error:
        found["one_gpu_per_rank"] = {"error": str(error)[-1500:]}
    return rows_from_result(found, expect, link_gbps)


def run(link_gbps: Optional[float]) -> int:
    gpus, source = gpus_here()
    if not gpus:
        print(no_gpu_message(socket.gethostname(), source), file=sys.stderr, flush=True)
        return NO_GPU_EXIT
    print(f"hvdtrain doctor --gpu: {len(gpus)} GPU(s) visible on {socket.gethostname()} ({source}); "
          f"one rank per GPU", flush=True)
    for line in gpus:
        print(f"  {line}", flush=True)
    rows = selftest(len(gpus), "cuda", link_gbps)
    print(render(rows), flush=True)
    print("\n" + summary(rows), flush=True)
    return exit_code(rows)

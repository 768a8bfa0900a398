"""The verdicts of ``hvdtrain doctor --gpu``: from the figures its worker job measured (one JSON
object, hvdtrain.bench.gpu.worker) to rows of the doctor's table, and from the rows to an exit code.

Pure functions, no torch: the same verdicts judge a run on GPUs and the CPU run of the tests, and
they are unit-tested on made-up figures. What a GPU is visible to this process is read without
CUDA (nvidia-smi -L, /proc), so that ``hvdtrain doctor --gpu`` on a machine without one says so
at once, with its own exit code.

Exit codes: 0 every row ok or WARN; 1 a row failed; 2 bad arguments (as every hvdtrain command);
NO_GPU_EXIT (3): no GPU visible here, nothing was tested.
"""
from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from hvdtrain.common.units import format_bytes
from hvdtrain.launch.doctor import FAIL, OK, WARN, Row

NO_GPU_EXIT = 3
# float64 on both sides: a distributed run differs from one process only in the order of additions
# (1e-16 per operation); the CPU tests hold 1e-10. On a GPU, cuBLAS may choose another kernel for a
# batch of B than for N*B (another order again): 1e-9 keeps five orders of margin, and a missing
# all-reduce or a wrong shard moves values by more than 1e-3 (checked by ``moved``).
EQUIVALENCE_TOLERANCE = 1e-9
MOVED_AT_LEAST = 1e-3
# bf16 keeps 8 bits of mantissa, fp16 11: after a few SGD steps the parameters differ from fp32's by
# about 1% of how far they moved. 20% says the step ran in that precision and no more; a step that
# skipped the all-reduce or the unscale is off by 100% or more.
PRECISION_TOLERANCE = 0.2
# nccl-tests' all-reduce reaches 70-90% of a link's per-direction figure on a healthy node, Horovod
# a little less (its fusion buffer copy). Under half says NCCL is not on that link (P2P disabled,
# PCIe instead of NVLink, another NUMA node): a warning, since the figure may be the wrong one.
BANDWIDTH_WARN_FRACTION = 0.5
# Nominal NVLink bandwidth per GPU and direction (NVIDIA's data sheets), which is what nccl-tests'
# bus bandwidth is measured against. Matched on torch.cuda.get_device_name(); first match wins.
# A PCIe card's figure depends on the slot and the switch: pass --link-gbps for it.
LINK_FIGURES: Sequence[Tuple[Tuple[str, ...], float, str]] = (
    (("B200",), 900.0, "NVLink 5"),
    (("H100", "SXM"), 450.0, "NVLink 4"),
    (("H100", "HBM3"), 450.0, "NVLink 4"),
    (("H200",), 450.0, "NVLink 4"),
    (("A100", "SXM"), 300.0, "NVLink 3"),
    (("V100", "SXM2"), 150.0, "NVLink 2"),
)


# ---- what GPUs this process can use, without CUDA --------------------------------------------

def gpus_from_nvidia_smi(listing: str) -> List[str]:
    """The GPU lines of ``nvidia-smi -L`` ("GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-...)"); MIG
    instances, listed under their GPU, are not separate lines here."""
    return [line.strip() for line in listing.splitlines() if line.strip().startswith("GPU ")]


def visible_gpus(listed: Sequence[str], cuda_visible_devices: Optional[str]) -> List[str]:
    """The GPUs of ``listed`` that CUDA_VISIBLE_DEVICES leaves to this process (indices or UUIDs)."""
    if cuda_visible_devices is None:
        return list(listed)
    chosen = []
    for entry in (part.strip() for part in cuda_visible_devices.split(",")):
        if not entry:
            continue
        if entry.isdigit():
            if int(entry) >= len(listed):
                break  # CUDA stops at the first invalid entry
            chosen.append(listed[int(entry)])
        elif entry.startswith("-"):
            break  # "-1": CUDA's way of hiding every GPU
        else:
            found = [line for line in listed if entry in line]
            if not found:
                break
            chosen.append(found[0])
    return chosen


def gpus_here(environ: Mapping[str, str] = os.environ) -> Tuple[List[str], str]:
    """(the GPUs this process may use, how they were found): nvidia-smi -L when it is installed,
    else the driver's /proc entries, else none ("no GPU visible")."""
    if shutil.which("nvidia-smi"):
        try:
            done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return [], "nvidia-smi -L gave no answer in 30 s"
        if done.returncode != 0:
            why = (done.stderr.strip() or done.stdout.strip() or "no message").splitlines()[-1]
            return [], f"nvidia-smi -L failed (exit {done.returncode}): {why}"
        listed, source = gpus_from_nvidia_smi(done.stdout), "nvidia-smi -L"
    elif os.path.isdir("/proc/driver/nvidia/gpus"):
        listed = [f"GPU {i}: bus {bus}" for i, bus in enumerate(sorted(os.listdir("/proc/driver/nvidia/gpus")))]
        source = "/proc/driver/nvidia/gpus"
    else:
        return [], "no nvidia-smi on PATH and no /proc/driver/nvidia: no NVIDIA driver here"
    shown = visible_gpus(listed, environ.get("CUDA_VISIBLE_DEVICES"))
    if "CUDA_VISIBLE_DEVICES" in environ:
        source += f", CUDA_VISIBLE_DEVICES={environ['CUDA_VISIBLE_DEVICES']!r}"
    return shown, source


def no_gpu_message(host: str, source: str) -> str:
    return (f"hvdtrain doctor --gpu: no GPU visible on {host} ({source}). Nothing was tested. Run it on a "
            f"GPU node, with the GPUs one job step will use visible to it, e.g. "
            f"srun -N1 --ntasks=1 --gpus-per-node=2 hvdtrain doctor --gpu (exit code {NO_GPU_EXIT}: no GPU)")


# ---- the figures -----------------------------------------------------------------------------

def bus_bandwidth(size_bytes: int, seconds: float, ranks: int) -> Tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in bytes/s of an all-reduce of ``size_bytes`` per rank
    that took ``seconds``: algbw = size / time; busbw = algbw * 2 (n - 1) / n, nccl-tests' formula
    (a ring all-reduce moves 2 (n - 1) / n of the buffer over each rank's link), comparable with
    the link's figure whatever the rank count."""
    if size_bytes <= 0 or seconds <= 0 or ranks <= 0:
        raise ValueError(f"bus_bandwidth needs a positive size, time and rank count, got "
                         f"{size_bytes} B, {seconds} s, {ranks} ranks")
    algbw = size_bytes / seconds
    return algbw, algbw * 2 * (ranks - 1) / ranks


def link_figure(gpu_name: str, override_gbps: Optional[float] = None) -> Optional[Tuple[float, str]]:
    """(GB/s per direction, where the figure comes from), or None when it is not known."""
    if override_gbps is not None:
        if override_gbps <= 0:
            raise ValueError(f"--link-gbps must be positive, got {override_gbps}")
        return override_gbps, "--link-gbps"
    for words, gbps, link in LINK_FIGURES:
        if all(word in gpu_name for word in words):
            return gbps, f"{link}, nominal for {gpu_name}"
    return None


def gbps(bytes_per_second: float) -> str:
    return f"{bytes_per_second / 1e9:.2f} GB/s"


# ---- rows ------------------------------------------------------------------------------------

def setup_rows(found: Mapping[str, Any], expect: str) -> List[Row]:
    """Horovod's build and the device every rank computes on."""
    where = f"{found['ranks']} ranks"
    rows = [Row("horovod", where, OK if expect != "cuda" or found["nccl_built"] else FAIL,
                f"horovod {found['horovod']}, torch {found['torch']} (CUDA {found['torch_cuda'] or 'none'}), "
                f"NCCL built: {found['nccl_built']}"
                + ("" if expect != "cuda" or found["nccl_built"] else
                   ". HINT: build Horovod with HOROVOD_GPU_OPERATIONS=NCCL (scripts/setup.sh on a node with nvcc "
                   "and a CUDA build of torch)"))]
    ranks = found["pinning"]
    wrong = [f"rank {r['rank']} on {r['device']}" for r in ranks if not r["device"].startswith(expect)]
    unpinned = [f"rank {r['rank']} computes on {r['device']} but its current CUDA device is cuda:{r['current']}"
                for r in ranks if r["device"].startswith("cuda") and r["device"] != f"cuda:{r['current']}"]
    shared = found.get("shared", [])
    problems = wrong + unpinned + list(shared)
    if wrong and expect == "cuda":
        problems.append(NO_GPU_HINT)
    rows.append(Row("pinning", where, FAIL if problems else OK, "; ".join(problems) if problems else listing(ranks)))
    return rows


NO_GPU_HINT = "HINT: torch sees no GPU in those ranks (a CPU build of torch, or CUDA_VISIBLE_DEVICES)"


def listing(ranks: Sequence[Mapping[str, Any]], visible_devices: bool = False) -> str:
    """"rank 0 n1 cuda:0 GPU-1a2b3c4d", one entry per rank (with the CUDA_VISIBLE_DEVICES it was given)."""
    return ", ".join(f"rank {r['rank']} {r['host']}"
                     + (f" CUDA_VISIBLE_DEVICES={r.get('cuda_visible_devices')}" if visible_devices else "")
                     + f" {r['device']}" + (f" {r['uuid'][:12]}" if r.get("uuid") else "") for r in ranks)


def one_gpu_per_rank_row(result: Mapping[str, Any], expect: str) -> Row:
    """The second layout (srun --gpus-per-task=1, a CUDA_VISIBLE_DEVICES wrapper): each rank given its
    local rank's GPU alone must compute on cuda:0, see one GPU, and no two ranks of a host share one.
    On the CPU the GPU part cannot be seen: the row then checks that the ranks were given distinct
    entries and stayed on the CPU, and says it is a CPU run."""
    check = "pinning 1 GPU/rank"
    if "error" in result:
        return Row(check, "", FAIL, result["error"])
    ranks, where = result["pinning"], f"{result['ranks']} ranks"
    given: Dict[Tuple[str, Optional[str]], List[int]] = {}
    for r in ranks:
        given.setdefault((r["host"], r.get("cuda_visible_devices")), []).append(r["rank"])
    problems = [f"ranks {', '.join(map(str, sharing))} on {host} were all given CUDA_VISIBLE_DEVICES={entry}"
                for (host, entry), sharing in given.items() if len(sharing) > 1]
    if expect != "cuda":
        problems += [f"rank {r['rank']} on {r['device']}" for r in ranks if r["device"] != "cpu"]
        detail = "; ".join(problems) if problems else f"CPU run, no GPU to pin: {listing(ranks, visible_devices=True)}"
        return Row(check, where, FAIL if problems else OK, detail)
    problems += [f"rank {r['rank']} on {r['device']}, not cuda:0 (its one GPU)" for r in ranks
                 if r["device"] != "cuda:0"]
    problems += [f"rank {r['rank']}'s current CUDA device is cuda:{r['current']}" for r in ranks
                 if r["device"] == "cuda:0" and r["current"] != 0]
    problems += [f"rank {r['rank']} sees {r['visible']} GPUs with CUDA_VISIBLE_DEVICES={r.get('cuda_visible_devices')}"
                 for r in ranks if r["visible"] != 1]
    problems += list(result.get("shared", []))
    if any(r["device"] == "cpu" for r in ranks):
        problems.append(NO_GPU_HINT)
    return Row(check, where, FAIL if problems else OK,
               "; ".join(problems) if problems else listing(ranks, visible_devices=True))


def allreduce_rows(measured: Sequence[Mapping[str, Any]], ranks: int, link: Optional[Tuple[float, str]],
                   on_gpu: bool = True) -> List[Row]:
    """One row per size; the largest is judged against the link's figure.

    Args:
        measured: one record per size: bytes, seconds, correct.
        ranks: ranks in the all-reduce.
        link: (GB/s, its name) of the link to judge against, or None when unknown.
        on_gpu: the ranks computed on GPUs (on CPUs no link figure is asked for).
    """
    rows = []
    largest = max((m["bytes"] for m in measured), default=0)
    for m in measured:
        label = f"allreduce {format_bytes(m['bytes'])}"
        if not m["correct"]:
            rows.append(Row(label, f"{ranks} ranks", FAIL, f"wrong sum: {m['detail']}"))
            continue
        algbw, busbw = bus_bandwidth(m["bytes"], m["seconds"], ranks)
        detail = f"{m['seconds'] * 1e3:.3f} ms, algbw {gbps(algbw)}, busbw {gbps(busbw)}"
        status = OK
        if ranks == 1:
            detail += " (one rank: no link crossed)"
        elif link is not None:
            share = busbw / (link[0] * 1e9)
            detail += f" = {share:.0%} of {link[0]:g} GB/s ({link[1]})"
            if m["bytes"] == largest and share < BANDWIDTH_WARN_FRACTION:
                status = WARN
                detail += (f"; under {BANDWIDTH_WARN_FRACTION:.0%}: check nvidia-smi topo -m and NCCL_DEBUG=INFO "
                           f"for the transport NCCL chose")
        elif m["bytes"] == largest and on_gpu:
            detail += "; link figure unknown for this GPU: pass --link-gbps to compare"
        rows.append(Row(label, f"{ranks} ranks", status, detail))
    return rows


def equivalence_row(check: str, result: Mapping[str, Any], tolerance: float = EQUIVALENCE_TOLERANCE) -> Row:
    """A distributed run against one process on the same global batch: ``worst`` is the largest
    parameter difference, ``moved`` how far training moved them (a run that did not move proves
    nothing)."""
    where = result.get("where", "")
    if "skipped" in result:
        return Row(check, where, WARN, f"not run: {result['skipped']}")
    if "error" in result:
        return Row(check, where, FAIL, result["error"])
    worst, moved = result["worst"], result["moved"]
    detail = f"max |distributed - one process| {worst:.2e} (limit {tolerance:.0e}), moved {moved:.2e}"
    if moved < MOVED_AT_LEAST:
        return Row(check, where, FAIL, detail + ": training did not move the parameters")
    return Row(check, where, OK if worst <= tolerance else FAIL, detail)


def precision_row(check: str, result: Mapping[str, Any], tolerance: float = PRECISION_TOLERANCE) -> Row:
    """A few steps under autocast against the same steps in fp32: finite, taken, and close."""
    where = result.get("where", "")
    if "error" in result:
        return Row(check, where, FAIL, result["error"])
    worst, moved, skipped, steps = result["worst"], result["moved"], result["skipped_steps"], result["steps"]
    detail = (f"{steps - skipped}/{steps} steps taken, max |{check} - fp32| {worst:.2e} = "
              f"{worst / moved if moved else float('inf'):.1%} of fp32's movement {moved:.2e} (limit {tolerance:.0%})")
    if not result["finite"]:
        return Row(check, where, FAIL, detail + ": non-finite parameters")
    if skipped >= steps:
        return Row(check, where, FAIL, detail + ": every step was skipped (inf/nan gradients)")
    if moved < MOVED_AT_LEAST:
        return Row(check, where, FAIL, detail + ": fp32 training did not move the parameters")
    return Row(check, where, OK if worst <= tolerance * moved else FAIL, detail)


def memory_row(peaks: Sequence[Mapping[str, Any]], expect: str) -> Row:
    """Every rank's CUDA allocator peaks (the figures the memory report and the OOM message use)."""
    where = f"{len(peaks)} ranks"
    if expect != "cuda":
        return Row("cuda memory", where, OK, "CPU run: no CUDA allocator; peak RSS "
                   + ", ".join(format_bytes(p["peak_rss"]) for p in peaks))
    missing = [str(p["rank"]) for p in peaks if not p.get("cuda_peak_allocated")]
    listing = "; ".join(f"rank {p['rank']} allocated {format_bytes(p.get('cuda_peak_allocated', 0))} reserved "
                        f"{format_bytes(p.get('cuda_peak_reserved', 0))} of {format_bytes(p.get('total', 0))}"
                        for p in peaks)
    if missing:
        return Row("cuda memory", where, FAIL, f"no CUDA peak on rank(s) {', '.join(missing)}: {listing}")
    return Row("cuda memory", where, OK, listing)


def rows_from_result(found: Mapping[str, Any], expect: str, link_gbps: Optional[float] = None) -> List[Row]:
    """Every row of the self-test, in the order the worker ran the checks (the second job's pinning
    beside the first's)."""
    rows = setup_rows(found, expect)
    if "one_gpu_per_rank" in found:
        rows.append(one_gpu_per_rank_row(found["one_gpu_per_rank"], expect))
    gpu_name = found.get("gpu_name") or ""
    rows += allreduce_rows(found["allreduce"], found["ranks"], link_figure(gpu_name, link_gbps), expect == "cuda")
    for name, result in found["strategies"].items():
        rows.append(equivalence_row(f"strategy {name}", result))
    for name, result in found["model_parallel"].items():
        rows.append(equivalence_row(f"mesh {name}", result))
    for name, result in found["precision"].items():
        rows.append(precision_row(name, result))
    rows.append(memory_row(found["memory"], expect))
    return rows


def exit_code(rows: Sequence[Row]) -> int:
    return 1 if any(row.status == FAIL for row in rows) else 0


def summary(rows: Sequence[Row]) -> str:
    failed = [row.check for row in rows if row.status == FAIL]
    warned = [row.check for row in rows if row.status == WARN]
    if failed:
        return f"hvdtrain doctor --gpu: FAIL, {len(failed)} of {len(rows)} checks failed: {', '.join(failed)}"
    return (f"hvdtrain doctor --gpu: PASS, {len(rows) - len(warned)} of {len(rows)} checks ok"
            + (f", warnings: {', '.join(warned)}" if warned else ""))

"""The verdicts of ``hvdtrain doctor --gpu`` on made-up figures: the bus-bandwidth formula, which
GPUs a process sees, and each row's pass/warn/fail (hvdtrain.launch.gpu_selftest). The worker that
measures the figures runs for real on CPU tensors in tests/launch/test_gpu_selftest.py."""
import pytest

from hvdtrain.launch import gpu_selftest as selftest
from hvdtrain.launch.doctor import Row

LISTING = """GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-aaaa1111)
  MIG 1g.10gb     Device  0: (UUID: MIG-xxxx)
GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-bbbb2222)
GPU 2: NVIDIA A100-SXM4-80GB (UUID: GPU-cccc3333)
"""


def test_bus_bandwidth_is_nccl_tests_formula():
    # 1 GB in 10 ms: algbw 100 GB/s; a ring of 8 moves 2*7/8 of it over each link: busbw 175 GB/s.
    algbw, busbw = selftest.bus_bandwidth(10**9, 0.01, 8)
    assert algbw == pytest.approx(100e9) and busbw == pytest.approx(175e9)
    assert selftest.bus_bandwidth(10**9, 0.01, 2)[1] == pytest.approx(100e9)  # 2 ranks: busbw = algbw
    assert selftest.bus_bandwidth(10**9, 0.01, 1)[1] == 0  # one rank crosses no link
    for bad in ((0, 0.01, 2), (10, 0.0, 2), (10, 0.01, 0)):
        with pytest.raises(ValueError, match="positive size, time and rank count"):
            selftest.bus_bandwidth(*bad)


def test_the_gpus_of_nvidia_smi_that_cuda_visible_devices_leaves():
    listed = selftest.gpus_from_nvidia_smi(LISTING)
    assert [line[:5] for line in listed] == ["GPU 0", "GPU 1", "GPU 2"]  # the MIG line is not a GPU
    assert selftest.visible_gpus(listed, None) == listed
    assert selftest.visible_gpus(listed, "2,0") == [listed[2], listed[0]]
    assert selftest.visible_gpus(listed, "GPU-bbbb2222") == [listed[1]]
    assert selftest.visible_gpus(listed, "") == []
    assert selftest.visible_gpus(listed, "-1") == []
    assert selftest.visible_gpus(listed, "1,7,0") == [listed[1]]  # CUDA stops at the first invalid entry


def test_the_link_figure_is_known_for_sxm_gpus_and_given_for_the_others():
    assert selftest.link_figure("NVIDIA A100-SXM4-80GB") == (300.0, "NVLink 3, nominal for NVIDIA A100-SXM4-80GB")
    assert selftest.link_figure("NVIDIA H100 80GB HBM3")[0] == 450.0
    assert selftest.link_figure("NVIDIA A100 80GB PCIe") is None
    assert selftest.link_figure("NVIDIA A100 80GB PCIe", 25.0) == (25.0, "--link-gbps")
    with pytest.raises(ValueError, match="--link-gbps must be positive"):
        selftest.link_figure("x", 0.0)


def measured(size, seconds, correct=True, detail=""):
    return {"bytes": size, "seconds": seconds, "correct": correct, "detail": detail}


def test_allreduce_rows_judge_the_largest_size_against_the_link():
    link = (300.0, "NVLink 3")
    # 256 MiB in 2 ms at 8 ranks: busbw 235 GB/s = 78% of 300: ok.
    rows = selftest.allreduce_rows([measured(2**20, 1e-4), measured(2**28, 2e-3)], 8, link)
    assert [r.status for r in rows] == ["ok", "ok"]
    assert "busbw 234.88 GB/s = 78% of 300 GB/s (NVLink 3)" in rows[1].detail
    # 10 ms: 47 GB/s = 16% of the link: a warning naming what to look at.
    slow = selftest.allreduce_rows([measured(2**20, 1e-4), measured(2**28, 1e-2)], 8, link)
    assert [r.status for r in slow] == ["ok", "WARN"] and "nvidia-smi topo -m" in slow[1].detail
    wrong = selftest.allreduce_rows([measured(2**20, 0.0, False, "rank 1: 3 of 262144 elements not 3")], 2, link)
    assert wrong[0].status == "FAIL" and "rank 1: 3 of 262144" in wrong[0].detail
    unknown = selftest.allreduce_rows([measured(2**28, 1e-2)], 2, None)
    assert unknown[0].status == "ok" and "pass --link-gbps" in unknown[0].detail


@pytest.mark.parametrize("result,status,words", [
    ({"worst": 3e-16, "moved": 0.05}, "ok", "3.00e-16 (limit 1e-09)"),
    ({"worst": 2e-3, "moved": 0.05}, "FAIL", "2.00e-03"),
    ({"worst": 0.0, "moved": 1e-5}, "FAIL", "did not move"),
    ({"error": "RuntimeError: NCCL error"}, "FAIL", "NCCL error"),
    ({"skipped": "T=2 x P=1 needs a multiple of 2 GPUs, 1 visible"}, "WARN", "not run: T=2"),
])
def test_equivalence_rows(result, status, words):
    row = selftest.equivalence_row("strategy zero2", {**result, "where": "2 ranks"})
    assert row.status == status and words in row.detail


@pytest.mark.parametrize("result,status,words", [
    ({"worst": 0.003, "moved": 0.35, "finite": True, "skipped_steps": 1, "steps": 8}, "ok", "7/8 steps taken"),
    ({"worst": 0.2, "moved": 0.35, "finite": True, "skipped_steps": 0, "steps": 8}, "FAIL", "57.1% of"),
    ({"worst": 0.0, "moved": 0.35, "finite": False, "skipped_steps": 0, "steps": 8}, "FAIL", "non-finite"),
    ({"worst": 0.0, "moved": 0.35, "finite": True, "skipped_steps": 8, "steps": 8}, "FAIL", "every step was skipped"),
])
def test_precision_rows(result, status, words):
    row = selftest.precision_row("fp16", result)
    assert row.status == status and words in row.detail


def pinned(rank, device, current, uuid, host="n1", visible=2, given=None):
    return {"rank": rank, "host": host, "device": device, "current": current, "uuid": uuid, "visible": visible,
            "cuda_visible_devices": given}


def one_gpu_each(*ranks, shared=()):
    return {"ranks": len(ranks), "pinning": list(ranks), "shared": list(shared)}


HEALTHY_ONE_GPU_EACH = one_gpu_each(pinned(0, "cuda:0", 0, "GPU-a", visible=1, given="0"),
                                    pinned(1, "cuda:0", 0, "GPU-b", visible=1, given="1"))


def found(**changes):
    result = {"ranks": 2, "horovod": "0.28.1", "torch": "2.13.0+cu130", "torch_cuda": "13.0", "nccl_built": True,
              "gpu_name": "NVIDIA A100-SXM4-80GB",
              "pinning": [pinned(0, "cuda:0", 0, "GPU-a"), pinned(1, "cuda:1", 1, "GPU-b")], "shared": [],
              "one_gpu_per_rank": HEALTHY_ONE_GPU_EACH,
              "allreduce": [measured(2**28, 1.2e-3)],  # busbw 224 GB/s: 75% of NVLink 3
              "strategies": {s: {"worst": 1e-16, "moved": 0.05, "where": "2 ranks"} for s in ("ddp", "fsdp")},
              "model_parallel": {"T=2": {"worst": 4e-14, "moved": 0.05, "where": "2 ranks"}},
              "precision": {"bf16": {"worst": 1e-3, "moved": 0.3, "finite": True, "skipped_steps": 0, "steps": 8}},
              "memory": [{"rank": r, "peak_rss": 2**30, "cuda_peak_allocated": 2**27, "cuda_peak_reserved": 2**28,
                          "total": 80 * 2**30} for r in (0, 1)]}
    return {**result, **changes}


def test_a_healthy_node_passes_with_every_check_in_one_table():
    rows = selftest.rows_from_result(found(), "cuda")
    assert [r.check for r in rows] == ["horovod", "pinning", "pinning 1 GPU/rank", "allreduce 256.0 MiB",
                                       "strategy ddp", "strategy fsdp", "mesh T=2", "bf16", "cuda memory"]
    assert all(r.status == "ok" for r in rows), rows
    assert selftest.exit_code(rows) == 0 and selftest.summary(rows).startswith("hvdtrain doctor --gpu: PASS, 9 of 9")
    assert rows[2].detail == ("rank 0 n1 CUDA_VISIBLE_DEVICES=0 cuda:0 GPU-a, "
                              "rank 1 n1 CUDA_VISIBLE_DEVICES=1 cuda:0 GPU-b")
    assert "allocated 128.0 MiB reserved 256.0 MiB of 80.0 GiB" in rows[-1].detail


@pytest.mark.parametrize("changes,check,words", [
    ({"nccl_built": False}, "horovod", "HOROVOD_GPU_OPERATIONS=NCCL"),
    ({"pinning": [pinned(0, "cpu", None, None), pinned(1, "cpu", None, None)]}, "pinning", "torch sees no GPU"),
    ({"pinning": [pinned(0, "cuda:0", 0, "GPU-a"), pinned(1, "cuda:1", 0, "GPU-b")]}, "pinning",
     "rank 1 computes on cuda:1 but its current CUDA device is cuda:0"),
    ({"shared": ["ranks 0, 1 on n1 use the same GPU (GPU-a)"]}, "pinning", "use the same GPU"),
    ({"memory": [{"rank": 0, "peak_rss": 1, "cuda_peak_allocated": 0}]}, "cuda memory", "no CUDA peak on rank(s) 0"),
    ({"one_gpu_per_rank": {"error": "mpirun ... exited 1: ranks 0, 1 on n1 use the same GPU"}}, "pinning 1 GPU/rank",
     "use the same GPU"),
    ({"one_gpu_per_rank": one_gpu_each(pinned(0, "cuda:0", 0, "GPU-a", visible=1, given="0"),
                                       pinned(1, "cuda:1", 1, "GPU-b", visible=2, given="0,1"))},
     "pinning 1 GPU/rank",
     "rank 1 on cuda:1, not cuda:0 (its one GPU); rank 1 sees 2 GPUs with CUDA_VISIBLE_DEVICES=0,1"),
    ({"one_gpu_per_rank": one_gpu_each(pinned(0, "cuda:0", 0, "GPU-a", visible=1, given="0"),
                                       pinned(1, "cuda:0", 0, "GPU-a", visible=1, given="0"),
                                       shared=["ranks 0, 1 on n1 use the same GPU (GPU-a)"])},
     "pinning 1 GPU/rank", "ranks 0, 1 on n1 were all given CUDA_VISIBLE_DEVICES=0; ranks 0, 1 on n1 use the same GPU"),
    ({"one_gpu_per_rank": one_gpu_each(pinned(0, "cuda:0", 0, "GPU-a", visible=1, given="0"),
                                       pinned(1, "cpu", None, None, visible=0, given="1"))},
     "pinning 1 GPU/rank", "rank 1 on cpu, not cuda:0 (its one GPU); rank 1 sees 0 GPUs"),
])
def test_each_failure_fails_its_row_and_the_exit_code(changes, check, words):
    rows = selftest.rows_from_result(found(**changes), "cuda")
    failed = [r for r in rows if r.status == "FAIL"]
    assert [r.check for r in failed] == [check] and words in failed[0].detail
    assert selftest.exit_code(rows) == 1
    assert selftest.summary(rows) == f"hvdtrain doctor --gpu: FAIL, 1 of {len(rows)} checks failed: {check}"


def test_warnings_do_not_fail_the_node():
    rows = [Row("a", "h", "ok", ""), Row("mesh P=2", "h", "WARN", "not run")]
    assert selftest.exit_code(rows) == 0
    assert selftest.summary(rows) == "hvdtrain doctor --gpu: PASS, 1 of 2 checks ok, warnings: mesh P=2"


def test_no_gpu_has_its_own_exit_code_distinct_from_pass_fail_and_bad_arguments():
    assert selftest.NO_GPU_EXIT not in (0, 1, 2)
    message = selftest.no_gpu_message("login1", "no nvidia-smi on PATH")
    assert "no GPU visible on login1" in message and "Nothing was tested" in message
    assert f"exit code {selftest.NO_GPU_EXIT}" in message


def test_a_cpu_run_of_the_one_gpu_per_rank_layout_says_so_and_checks_what_it_can():
    """Without a GPU, each rank's own CUDA_VISIBLE_DEVICES entry is what can be checked."""
    cpu = one_gpu_each(pinned(0, "cpu", None, None, visible=0, given="0"), pinned(1, "cpu", None, None, visible=0,
                                                                                     given="1"))
    row = selftest.one_gpu_per_rank_row(cpu, "cpu")
    assert row.status == "ok"
    assert row.detail == ("CPU run, no GPU to pin: rank 0 n1 CUDA_VISIBLE_DEVICES=0 cpu, "
                          "rank 1 n1 CUDA_VISIBLE_DEVICES=1 cpu")
    same = one_gpu_each(pinned(0, "cpu", None, None, given="0"), pinned(1, "cpu", None, None, given="0"))
    row = selftest.one_gpu_per_rank_row(same, "cpu")
    assert row.status == "FAIL" and row.detail == "ranks 0, 1 on n1 were all given CUDA_VISIBLE_DEVICES=0"


@pytest.mark.parametrize("local_rank,visible,entry", [
    (1, None, "1"),                          # the launch hid nothing: the local rank is the index
    (1, "4,5,6,7", "5"),                     # the launch's own list: its local rank's entry
    (0, "GPU-aaaa1111, GPU-bbbb2222", "GPU-aaaa1111"),
])
def test_each_rank_keeps_its_local_rank_s_gpu(local_rank, visible, entry):
    from hvdtrain.bench.gpu.worker import gpu_of_local_rank

    assert gpu_of_local_rank(local_rank, visible) == entry


def test_a_rank_without_a_gpu_of_its_own_or_a_local_rank_is_refused():
    from hvdtrain.bench.gpu.worker import gpu_of_local_rank, keep_one_gpu

    with pytest.raises(ValueError, match="local rank 2 has no GPU of its own: CUDA_VISIBLE_DEVICES='0,1' lists 2"):
        gpu_of_local_rank(2, "0,1")
    with pytest.raises(ValueError, match="needs the launcher's local rank"):
        gpu_of_local_rank(None, None)
    environ = {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    keep_one_gpu(environ)  # what mpirun's rank 3 of a host does first
    assert environ["CUDA_VISIBLE_DEVICES"] == "3"

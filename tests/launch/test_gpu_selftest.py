"""``hvdtrain doctor --gpu`` on this machine, which has no GPU: it says so with its own exit code;
and the self-test's worker, run for real on CPU tensors (the same code a GPU node runs, with the
device its start-up picks), passes every check here and fails the node when torch sees no GPU
that nvidia-smi lists. Both of its jobs run: every rank seeing every GPU, then each rank given
its local rank's GPU alone through CUDA_VISIBLE_DEVICES (on the CPU: the entries it was given)."""
import os
import stat

from hvdtrain.bench.gpu.driver import selftest
from hvdtrain.launch.gpu_selftest import NO_GPU_EXIT, exit_code
from tests.launch.helpers import BIN, PYTHON, run

SIZES = [64 * 1024, 1024 * 1024]  # small: the CPU run proves the checks, not a bandwidth


def fake_nvidia_smi(monkeypatch, directory, gpus):
    """An nvidia-smi that lists ``gpus`` GPUs (what a GPU node's driver says), on PATH."""
    script = directory / "nvidia-smi"
    lines = "\n".join(f"GPU {i}: NVIDIA A100-SXM4-80GB (UUID: GPU-{i:04d})" for i in range(gpus))
    script.write_text(f"#!/bin/sh\n[ \"$1\" = -L ] || exit 9\ncat <<'E'\n{lines}\nE\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")


def test_without_a_gpu_doctor_gpu_says_so_and_exits_with_its_own_code():
    code, out, err = run([str(BIN / "hvdtrain"), "doctor", "--gpu"], timeout=60)
    assert code == NO_GPU_EXIT == 3, out + err
    assert "no GPU visible on" in err and "Nothing was tested" in err


def test_gpus_hidden_by_cuda_visible_devices_are_not_visible(tmp_path, monkeypatch):
    fake_nvidia_smi(monkeypatch, tmp_path, 4)
    code, out, err = run([str(BIN / "hvdtrain"), "doctor", "--gpu"], timeout=60,
                         extra_env={"CUDA_VISIBLE_DEVICES": "-1"})
    assert code == NO_GPU_EXIT, out + err
    assert "nvidia-smi -L, CUDA_VISIBLE_DEVICES='-1'" in err


def test_bad_arguments_exit_2():
    for argv in (["--link-gbps", "300"], ["--gpu", "--link-gbps", "-1"], ["--gpu", "-H", "a:2"]):
        code, out, err = run([str(BIN / "hvdtrain"), "doctor", *argv], timeout=60)
        assert code == 2, (argv, out, err)


def test_every_check_of_the_worker_passes_on_cpu_tensors():
    rows = selftest(2, "cpu", sizes=SIZES, iters=3, timeout=600)
    by_check = {row.check: row for row in rows}
    assert list(by_check) == ["horovod", "pinning", "pinning 1 GPU/rank", "allreduce 64.0 KiB", "allreduce 1.0 MiB",
                              "strategy ddp", "strategy zero1", "strategy zero2", "strategy fsdp", "strategy ps",
                              "mesh T=2", "mesh P=2", "bf16", "fp16", "cuda memory"]
    assert all(row.status == "ok" for row in rows), "\n".join(map(str, rows))
    assert exit_code(rows) == 0
    assert by_check["pinning"].detail.count(" cpu") == 2
    # The second job's ranks were each given their local rank's entry, before Horovod and CUDA started.
    one_each = by_check["pinning 1 GPU/rank"].detail
    assert one_each.startswith("CPU run, no GPU to pin: rank 0 ") and "CUDA_VISIBLE_DEVICES=0 cpu" in one_each
    assert "CUDA_VISIBLE_DEVICES=1 cpu" in one_each


def test_a_gpu_node_whose_torch_sees_no_gpu_fails_the_pinning_row(tmp_path, monkeypatch):
    """nvidia-smi lists 2 GPUs, torch sees none (a CPU build, or a CUDA build on a machine without
    one): the job runs on 2 ranks (the default sizes: 3 all-reduce rows) and the verdict is FAIL with
    the hint, exit 1. The horovod row fails too when this Horovod was built without NCCL (with a CPU
    torch), and passes when it was (a CUDA torch beside a CUDA toolkit)."""
    built = run([PYTHON, "-c", "import horovod.torch as hvd; print(bool(hvd.nccl_built()))"], timeout=120)
    assert built[0] == 0, built
    nccl = built[1].strip().splitlines()[-1] == "True"
    fake_nvidia_smi(monkeypatch, tmp_path, 2)
    code, out, err = run([str(BIN / "hvdtrain"), "doctor", "--gpu"], timeout=600)
    assert code == 1, out + err
    pinning = [line for line in out.splitlines() if line.startswith("pinning")]
    assert pinning and " FAIL " in pinning[0] and "rank 0 on cpu" in pinning[0] and "torch sees no GPU" in pinning[0]
    horovod = [line for line in out.splitlines() if line.startswith("horovod")]
    assert (" FAIL " in horovod[0]) != nccl and f"NCCL built: {nccl}" in horovod[0], horovod
    one_each = [line for line in out.splitlines() if line.startswith("pinning 1 GPU/rank")]
    assert " FAIL " in one_each[0] and "rank 0 on cpu, not cuda:0 (its one GPU)" in one_each[0]
    failed = ([] if nccl else ["horovod"]) + ["pinning", "pinning 1 GPU/rank", "cuda memory"]
    assert f"hvdtrain doctor --gpu: FAIL, {len(failed)} of 16 checks failed: {', '.join(failed)}" in out, out

"""The memory report of a run on GPUs (hvdtrain.observability.memory.MemoryReport): each rank's
counted bytes, with the CUDA allocator's peaks beside them, as rank 0 logs and records them. A
stand-in torch.cuda gives this rank's peaks and a stand-in gather adds rank 1's record: the GPU
figures this machine cannot produce, through the code that prints them."""
import types

import torch

from hvdtrain.observability import memory

MiB, GiB = 2**20, 2**30


class ZeroStrategy:
    name = label = "zero2"

    def memory_bytes(self):
        return {"parameters": 6 * MiB, "gradients": 3 * MiB, "optimizer_state": 12 * MiB}


class Recorded:
    """A run directory's record() and a logger's info(), kept."""

    def __init__(self):
        self.lines, self.records = [], []

    def info(self, text):
        self.lines.append(text)

    def record(self, kind, payload):
        self.records.append((kind, payload))


def test_a_gpu_run_reports_the_allocator_peaks_beside_the_counted_bytes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 3 * GiB if device.index == 0 else -1)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device: 4 * GiB if device.index == 0 else -1)
    monkeypatch.setattr(memory, "peak_rss_bytes", lambda: 700 * MiB)
    rank_1 = {"parameters": 6 * MiB, "gradients": 3 * MiB, "optimizer_state": 12 * MiB, "total": 21 * MiB,
              "peak_rss": 690 * MiB, "cuda_peak_allocated": int(3.5 * GiB), "cuda_peak_reserved": 5 * GiB}
    gathered = []
    monkeypatch.setattr(memory.collectives, "allgather_object",
                        lambda mine, name: gathered.append(name) or [mine, rank_1])
    log = Recorded()
    topology = types.SimpleNamespace(world=types.SimpleNamespace(device=torch.device("cuda", 0), is_root=True, rank=0),
                                     log=log)
    run_dir = Recorded()
    memory.MemoryReport(ZeroStrategy(), topology).after_first_step(run_dir, step=1)

    assert gathered == ["trainer.memory"]
    assert log.lines == [
        "memory held per rank (zero2, counted from tensor storages; peak RSS of the process; on a GPU, torch's peak "
        "allocated and reserved):\n"
        "  rank 0: parameters 6.0 MiB, gradients 3.0 MiB, optimizer_state 12.0 MiB, total 21.0 MiB, peak_rss 700.0 MiB, "
        "cuda_peak_allocated 3.0 GiB, cuda_peak_reserved 4.0 GiB\n"
        "  rank 1: parameters 6.0 MiB, gradients 3.0 MiB, optimizer_state 12.0 MiB, total 21.0 MiB, peak_rss 690.0 MiB, "
        "cuda_peak_allocated 3.5 GiB, cuda_peak_reserved 5.0 GiB"]
    [(kind, payload)] = run_dir.records
    assert kind == "memory" and payload["step"] == 1 and payload["strategy"] == "zero2"
    assert [r["cuda_peak_reserved"] for r in payload["per_rank"]] == [4 * GiB, 5 * GiB]

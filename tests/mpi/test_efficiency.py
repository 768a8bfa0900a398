"""Tokens/s, TFLOPs/s per rank and MFU through the Trainer: the start line names the peak, and the log
line, the step and epoch records, the CSV and TensorBoard hold the figures of the model's FLOPs."""
import csv
import json

import pytest
import torch
from torch.utils.data import TensorDataset

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss
from hvdtrain.trainer import Trainer

pytestmark = [pytest.mark.mpi, pytest.mark.np1(reason="the per-rank share of the FLOPs at one rank (divided by 1)"),
              pytest.mark.skip_gloo(reason="the figures are rank 0's records: nothing goes through the transport")]

SEQ, WIDTH, LAYERS = 8, 16, 1


def test_the_log_line_records_csv_and_tensorboard_carry_tokens_tflops_and_mfu(world, shared_tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.manual_seed(0)
    ids = torch.randint(0, 20, (64, SEQ + 1))
    data = TensorDataset(ids[:, :-1], ids[:, 1:])
    model = TinyTransformerLM(20, seq_len=SEQ, d_model=WIDTH, layers=LAYERS, heads=2)
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2) - SEQ * WIDTH  # no position lookup
    per_sample = (6 * matrices + 12 * LAYERS * WIDTH * SEQ) * SEQ  # PaLM's, as the unit test checks
    config = TrainConfig(epochs=1, batch_size=4, lr=0.01, warmup_epochs=0, seed=3, max_steps=4, log_every=2,
                         progress="log", run_dir=str(shared_tmp_path / "runs"), run_name="efficiency", loggers=["csv"])
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=config.lr), data, loss_fn=lm_loss,
                      config=config, world=world)
    peak = trainer.parts.reporter.efficiency.peak.flops_per_sec
    trainer.fit()
    trainer.close()
    collectives.allgather_object(None, name="efficiency.done")  # every rank closed its files

    if world.is_root:
        run = shared_tmp_path / "runs" / "efficiency"
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if r["kind"] == "step"]
        (epoch,) = [r for r in records if r["kind"] == "epoch"]
        assert [r["step"] for r in steps] == [2, 4]
        for record in steps + [epoch]:
            rate = record["samples_per_sec"]
            assert record["tokens_per_sec"] == pytest.approx(rate * SEQ)
            assert record["tflops_per_rank"] == pytest.approx(rate * per_sample / world.size / 1e12)
            assert record["mfu"] == pytest.approx(record["tflops_per_rank"] * 1e12 / peak)
        log = (run / "logs" / "rank-0.log").read_text()
        assert f"peak {peak / 1e12:.3g} TFLOPs/s per rank, measured float32 matmul" in log
        assert f"GFLOPs per sample, {per_sample / SEQ / 1e6:.4g} MFLOPs per token (FlopCounterMode" in log
        last = steps[-1]
        assert (f"step 4/4 loss {last['loss']:.4f} lr {last['lr']:.4g} {last['samples_per_sec']:.0f} samples/s, "
                f"{last['tokens_per_sec']:.0f} tokens/s, {last['tflops_per_rank']:.3g} TFLOPs/s per rank, "
                f"MFU {last['mfu']:.1%}, ") in log
        with open(run / "metrics-step.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        assert [float(row["mfu"]) for row in rows] == [r["mfu"] for r in steps]
        events = EventAccumulator(str(run / "tensorboard")).Reload()
        for key in ("tokens_per_sec", "tflops_per_rank", "mfu"):
            assert [e.step for e in events.Scalars(f"step/{key}")] == [2, 4]
            assert events.Scalars(f"step/{key}")[-1].value == pytest.approx(last[key], rel=1e-6)

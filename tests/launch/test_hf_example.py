"""train_hf.py: a Llama built on the meta device, split by its own tensor-parallel plan (T=2), learns
the shipped text; its hf/ export loads in plain transformers and scores the held-out text as the
run did; a second run starts from that directory under fsdp and begins where the first ended. Cut
into two pipeline stages it learns too, and its metrics.jsonl holds the metrics of the unsplit step."""
import json
import re

import pytest
import torch

from tests.launch.helpers import PYTHON, run

transformers = pytest.importorskip("transformers")

MPIRUN = ["mpirun", "-np", "2", "--oversubscribe"]
# T=2 or P=2 on 2 ranks is one data-parallel worker: the rate is not scaled, and a warm-up would start
# at peak / 81 steps (0.2 epochs), longer than these 30-step runs. They run at the peak throughout.
AT_THE_PEAK = "--train.warmup_epochs=0"
FINAL = re.compile(r"final validation loss ([0-9.]+) nats/char = ([0-9.]+) bits/char on \d+ held-out "
                   r"characters, 2 workers \(unigram baseline: ([0-9.]+) bits/char\)")


def train_hf(run_dir, *settings):
    code, out, err = run(MPIRUN + [PYTHON, "train_hf.py", "--train.epochs=1", f"--train.run_dir={run_dir}",
                                   "--train.run_name=run", *settings], timeout=300)
    assert code == 0, f"exit {code}\n{out[-3000:]}\n{err[-3000:]}"
    final = FINAL.search(out)
    assert final, out[-3000:]
    return out, float(final.group(1)), float(final.group(2)), float(final.group(3))


# What the Trainer's step reports for train_hf.py's (inputs, targets) windows, with or without a pipeline.
EPOCH_METRICS = {"train_loss", "train_accuracy", "val_loss", "val_accuracy", "val_samples"}


def epoch_metrics(run_dir) -> set:
    """The train_ and val_ names of the run's last epoch record in metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    epoch = [record for record in records if record["kind"] == "epoch"][-1]
    return {name for name in epoch if name.startswith(("train_", "val_"))}


def held_out_loss(directory) -> float:
    """The exported model's mean cross-entropy over the held-out windows, in this process."""
    from hvdtrain.examples.textlm import load_text_datasets

    _, val_set, _ = load_text_datasets(64, 64, 0.1)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    inputs = torch.stack([val_set[i][0] for i in range(len(val_set))])
    targets = torch.stack([val_set[i][1] for i in range(len(val_set))])
    with torch.no_grad():
        logits = model(input_ids=inputs).logits
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).item()


@pytest.mark.timeout(600)
def test_a_tensor_parallel_llama_learns_exports_and_is_continued_under_fsdp(tmp_path):
    out, loss, bpc, unigram = train_hf(tmp_path / "tp", "--train.tensor_parallel=2", "--train.max_steps=30", AT_THE_PEAK)
    assert "tensor plan: the model's own tp_plan" in out and "built on the meta device" in out
    assert bpc < unigram - 0.2, "30 steps learn more than the characters' frequencies"
    exported = tmp_path / "tp" / "run" / "hf"
    assert epoch_metrics(exported.parent) == EPOCH_METRICS
    # The printed loss has 4 decimals; the evaluation's batches sum in another order than one pass here.
    assert held_out_loss(exported) == pytest.approx(loss, abs=2e-4)

    # An AdamW step of lr 1e-9 moves no weight by more than 1e-9: the held-out loss is the first run's.
    out, continued, _, _ = train_hf(tmp_path / "fsdp", "--train.strategy=fsdp", f"--model.pretrained={exported}",
                                    "--train.lr=1e-9", "--train.max_steps=1")
    assert f"started from the pretrained weights in {exported}" in out
    assert continued == pytest.approx(loss, abs=2e-4)


@pytest.mark.timeout(600)
def test_a_llama_cut_into_two_pipeline_stages_learns(tmp_path):
    out, _, bpc, unigram = train_hf(tmp_path, "--train.pipeline_parallel=2", "--train.micro_batches=2",
                                    "--train.max_steps=30", AT_THE_PEAK)
    assert "mesh: data 1 x pipeline 2 x tensor 1" in out
    assert bpc < unigram - 0.2, "30 steps learn more than the characters' frequencies"
    assert epoch_metrics(tmp_path / "run") == EPOCH_METRICS, "the last stage reports the unsplit step's metrics"

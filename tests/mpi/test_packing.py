"""Packed rows through the Trainer (hvdtrain.data.packing): a stream of documents packed as it is read
and a map-style set packed at once, each row trained once per epoch across ranks, and the loss falls
on documents whose next token is learnable."""
from collections import Counter

import pytest
import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.data.packing import PackedRows, PackedStream, pack_documents, packed_lm_step
from hvdtrain.distributed import collectives
from hvdtrain.examples.textlm import TinyTransformerLM
from hvdtrain.trainer import Trainer

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.np1(reason="one rank trains every packed row"),
]
VOCAB, ROW, DOCUMENTS, BATCH = 32, 16, 200, 4


def counting_documents(epoch=0):
    """Documents of lognormal lengths, each counting up (mod VOCAB) from its own start: the next token is
    the previous one + 1, which a model learns in a few steps. Their order follows the epoch."""
    generator = torch.Generator().manual_seed(11)
    lengths = torch.empty(DOCUMENTS).log_normal_(1.6, 0.8, generator=generator).long().clamp(2, 2 * ROW)
    starts = torch.randint(0, VOCAB, (DOCUMENTS,), generator=generator)
    documents = [(torch.arange(length) + start) % VOCAB for start, length in zip(starts.tolist(), lengths.tolist())]
    return documents[epoch:] + documents[:epoch]


def recording(seen, losses):
    def step(model, batch):
        seen.extend(tuple(row) for row in batch["input_ids"].tolist())
        loss, metrics = packed_lm_step(model, batch)
        losses.append(float(loss.detach()))
        return loss, metrics
    return step


def trained_rows(world, model, dataset, max_steps=None):
    """Two epochs of ``dataset``: the trainer, and every rank's (rows of the first epoch, step losses)."""
    seen, losses = [], []
    config = TrainConfig(seed=5, batch_size=BATCH, epochs=2, lr=0.01, warmup_steps=0, max_steps=max_steps,
                         log_every=1000, progress="off", run_dir=None, tensorboard=False)
    trainer = Trainer(model, torch.optim.AdamW(model.parameters(), lr=config.lr), dataset, None, config,
                      world=world, step_fn=recording(seen, losses))
    trainer.fit()
    steps = trainer.global_step // 2
    return trainer, collectives.allgather_object((seen[:steps * BATCH], losses), name="packing.rows")


def learnt(gathered):
    """Every rank's mean loss of the last 3 steps against the first 3's."""
    return all(sum(losses[-3:]) < 0.5 * sum(losses[:3]) for _, losses in gathered)


def test_a_hugging_face_model_trains_on_a_stream_packed_as_it_is_read(world):
    transformers = pytest.importorskip("transformers")
    from tests.mpi.hf_models import tiny_config

    config = tiny_config("llama")
    config.vocab_size, config.max_position_embeddings = VOCAB, ROW
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    rows = [tuple(row["input_ids"].tolist()) for row in pack_documents(counting_documents(), ROW)]
    global_batch = BATCH * world.size
    steps = len(rows) // global_batch

    trainer, gathered = trained_rows(world, model, PackedStream(counting_documents, ROW), max_steps=1000)

    assert trainer.global_step == 2 * steps, "each epoch ends when the packed stream runs out"
    union = [row for rank_seen, _ in gathered for row in rank_seen]
    assert sorted(union) == sorted(rows[:steps * global_batch]), "each row of the whole global batches once"
    assert learnt(gathered), [losses for _, losses in gathered]


def test_the_example_transformer_trains_on_a_packed_map_style_set(world):
    torch.manual_seed(0)
    model = TinyTransformerLM(VOCAB, seq_len=ROW, d_model=32, layers=2, heads=4)
    dataset = PackedRows(counting_documents(), ROW)
    global_batch = BATCH * world.size

    trainer, gathered = trained_rows(world, model, dataset)

    assert trainer.global_step == 2 * (len(dataset) // global_batch)
    union = [row for rank_seen, _ in gathered for row in rank_seen]
    # Rows are told apart by their tokens, and two rows may hold the same: counted, none more often than packed.
    packed_rows = Counter(tuple(row["input_ids"].tolist()) for row in dataset.rows)
    assert len(union) == trainer.global_step // 2 * global_batch and not Counter(union) - packed_rows
    assert learnt(gathered), [losses for _, losses in gathered]

"""What a step's loss averages over (token_mean's counters), each micro-batch's weight in the step,
and the reported means weighed by it; the weighting's arithmetic checked in one process against the
global batch's gradient (the distributed runs: tests/mpi/test_token_mean.py)."""
import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.components import metrics, token_mean
from hvdtrain.components.steps import supervised_step
from hvdtrain.config.train import TrainConfig
from hvdtrain.data.packing import packed_lm_step

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 32, 6
SHAPE = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=SEQ)


def masked_labels(rows: int, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=generator)
    prompts = torch.randint(0, SEQ - 1, (rows,), generator=generator)
    return {"input_ids": ids, "labels": ids.masked_fill(torch.arange(SEQ) < prompts[:, None], -100)}


@pytest.mark.parametrize("loss_fn,expected", [
    (F.cross_entropy, -100),
    (F.nll_loss, -100),
    (nn.CrossEntropyLoss(ignore_index=0), 0),
    (nn.CrossEntropyLoss(label_smoothing=0.1), -100),  # still one term per target not ignored
    (nn.CrossEntropyLoss(weight=torch.ones(3)), None),  # a weighted mean: not a count
    (nn.CrossEntropyLoss(reduction="sum"), None),
    (functools.partial(F.cross_entropy, ignore_index=7), 7),
    (functools.partial(F.cross_entropy, reduction="sum"), None),
    (F.mse_loss, None),
    (lambda outputs, targets: F.cross_entropy(outputs, targets), None),  # opaque: samples
])
def test_the_ignore_index_of_a_cross_entropy_like_mean(loss_fn, expected):
    assert token_mean.ignore_index_of(loss_fn) == expected


def test_a_causal_lm_counts_each_positions_next_label():
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE))
    count = supervised_step(F.cross_entropy).count_items(model)
    batch = masked_labels(5)
    assert count(batch) == int((batch["labels"][:, 1:] != -100).sum())
    shifted = torch.full((5, SEQ), -100)
    shifted[:, :3] = 1
    assert count({**batch, "shift_labels": shifted}) == 15  # labels already shifted (a sequence part's)
    # ... which is what the model's own loss averages over: its loss times the count is the sum.
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"]).logits
        mean = model(**batch).loss
    summed = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch["labels"][:, 1:].reshape(-1), reduction="sum")
    assert torch.allclose(mean * count(batch), summed, rtol=1e-5)


def test_other_heads_average_over_samples():
    model = transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**SHAPE, num_labels=3))
    count = supervised_step(F.cross_entropy).count_items(model)
    assert count({"input_ids": torch.zeros(4, SEQ, dtype=torch.long), "labels": torch.tensor([0, 1, 2, 1])}) == 4


def test_a_loss_fn_counts_the_targets_it_does_not_ignore():
    step = supervised_step(nn.CrossEntropyLoss(ignore_index=0))
    count = step.count_items(nn.Linear(2, 2))
    targets = torch.tensor([[0, 1, 2], [3, 0, 0]])
    assert count((torch.zeros(2, 3), targets)) == 3
    assert count({"x": torch.zeros(2, 3), "labels": targets}) == 3
    # a regression's float targets, or an opaque loss: samples
    assert supervised_step(F.mse_loss).count_items(nn.Linear(2, 2))((torch.zeros(5, 2), torch.zeros(5, 2))) == 5
    assert supervised_step(F.cross_entropy).count_items(nn.Linear(2, 2))((torch.zeros(4, 2), torch.zeros(4, 2))) == 4


def test_packed_rows_count_their_next_labels():
    batch = masked_labels(3, seed=2)
    assert packed_lm_step.count_items(None)(batch) == int((batch["labels"][:, 1:] != -100).sum())


def summing_over(ranks: int, waited=None):
    """An all-reduce over ``ranks`` ranks holding the same counts as this one (started, then waited for:
    ``waited`` counts the waits)."""
    def start(tensor, name):
        def wait():
            if waited is not None:
                waited.append(name)
            return tensor * ranks
        return wait
    return start


def test_each_micro_batch_weighs_its_share_of_the_global_batch():
    waited = []
    items = token_mean.StepItems(lambda batch: batch, len, token_mean.TOKENS, summing_over(4, waited))
    # 4 ranks, 2 replicas of 2 ranks each (a tensor or sequence group reads one batch): the world's
    # sum counts every replica's batch twice.
    weights = items.weights([3, 5], accumulation=2, data_width=2, replication=2)
    assert not waited, "the all-reduce is waited for when a weight is read, after the forward"
    assert [float(w) for w in weights] == [3 * 2 / 16, 5 * 2 / 16]
    assert waited == ["train.scored_tokens"], "one wait per step"
    assert [float(w) for w in items.weights([0, 0], accumulation=2, data_width=2, replication=2)] == [0.0, 0.0]
    replica = token_mean.StepItems(lambda batch: batch, len, token_mean.REPLICA, summing_over(4))
    assert replica.weights([3, 5], accumulation=2, data_width=2, replication=2) == [0.5, 0.5]
    assert not token_mean.StepItems(None, len, token_mean.TOKENS, summing_over(4)).counts_tokens


def test_the_weights_give_the_global_batchs_gradient():
    """Two replicas of two micro-batches with uneven scored tokens: the replicas' averaged sum of
    weighted micro-batch gradients is the gradient of the global batch's token mean (float64, 1e-12:
    the same terms, summed in another order); the replicas' mean of their own means is not (> 1e-3)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE)).double()
    micro = [{k: v[i:i + 2] for k, v in masked_labels(8, seed=4).items()} for i in range(0, 8, 2)]
    counts = [int((m["labels"][:, 1:] != -100).sum()) for m in micro]
    assert len(set(counts)) > 1
    data_width, accumulation = 2, 2
    # One process: the world's sum is the count given.
    items = token_mean.StepItems(lambda b: b, len, token_mean.TOKENS, summing_over(1))
    weights = [float(w) for w in items.weights(counts, accumulation, data_width, replication=1)]

    def gradient(loss):
        model.zero_grad()
        loss.backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    whole = gradient(model(**{k: torch.cat([m[k] for m in micro]) for k in micro[0]}).loss)
    weighted = sum(gradient(model(**m).loss * w) for m, w in zip(micro, weights)) / data_width
    replicas = sum(gradient(model(**m).loss / accumulation) for m in micro) / data_width
    assert (weighted - whole).abs().max() < 1e-12
    assert (replicas - whole).abs().max() > 1e-3


def test_the_reported_loss_is_weighed_by_tokens_the_metrics_by_samples(monkeypatch):
    monkeypatch.setattr(metrics.collectives, "allreduce_sum", lambda tensor, name: tensor)
    means = metrics.RunningMeans(torch.device("cpu"))
    means.add(torch.tensor(1.0), {"accuracy": torch.tensor(0.5)}, samples=2, loss_weight=3)
    means.add(torch.tensor(2.0), {"accuracy": torch.tensor(1.0)}, samples=2, loss_weight=1)
    means.add(torch.tensor(float("nan")), {"accuracy": torch.tensor(0.0)}, samples=4, loss_weight=0)  # scores nothing
    totals = means.reduce("test")
    assert totals.means() == {"loss": pytest.approx(5 / 4), "accuracy": pytest.approx(3 / 8)}
    assert totals.count == 8 and totals.loss_weight == 4


def test_loss_mean_settings():
    assert TrainConfig().resolved_loss_mean == "tokens"
    assert TrainConfig(reduction="adasum").resolved_loss_mean == "replica"
    assert TrainConfig(loss_mean="replica").resolved_loss_mean == "replica"
    with pytest.raises(ValueError, match="loss_mean=tokens"):
        TrainConfig(reduction="adasum", loss_mean="tokens")
    with pytest.raises(ValueError, match="loss_mean"):
        TrainConfig(loss_mean="mean")

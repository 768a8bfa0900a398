import math

import pytest
import torch

from hvdtrain.config.loader import load_job
from hvdtrain.examples.textlm import (CharVocab, TextLMJob, TextLMModelConfig, TinyTransformerLM,
                                      WindowDataset, bits_per_char, generate, lm_loss, load_corpus,
                                      load_text_datasets, split_by_position, unigram_bits_per_char)


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


@pytest.fixture(scope="module")
def datasets(corpus):
    return load_text_datasets(seq_len=32, stride=16, val_fraction=0.1, text=corpus)


def small_model(vocab_size, seq_len=32, seed=0):
    torch.manual_seed(seed)
    return TinyTransformerLM(vocab_size, seq_len=seq_len, d_model=32, layers=2, heads=4)


def test_the_corpus_is_the_language_reference_in_a_fixed_order(corpus):
    assert len(corpus) > 200_000
    assert "The \"if\" statement" in corpus and "is used for conditional execution" in corpus
    assert load_corpus() == corpus
    assert 60 <= len(CharVocab(corpus)) <= 200


def test_the_split_is_by_position_disjoint_and_complete(corpus, datasets):
    train, val, vocab = datasets
    ids = vocab.encode(corpus)
    assert torch.equal(torch.cat([train.ids, val.ids]), ids)
    assert len(val.ids) == round(len(ids) * 0.1)
    # Every window reads its own part only: the last training target comes before the cut.
    last_start = (len(train) - 1) * train.stride
    assert last_start + train.seq_len + 1 <= len(train.ids)
    first, second = split_by_position(torch.arange(10), 0.3)
    assert first.tolist() == list(range(7)) and second.tolist() == [7, 8, 9]
    with pytest.raises(ValueError):
        split_by_position(torch.arange(10), 1.0)


def test_targets_are_the_inputs_shifted_by_one_and_windows_step_by_the_stride():
    ids = torch.arange(100)
    windows = WindowDataset(ids, seq_len=8, stride=5)
    assert len(windows) == (100 - 9) // 5 + 1
    for index in (0, 1, len(windows) - 1):
        inputs, targets = windows[index]
        assert inputs.tolist() == list(range(5 * index, 5 * index + 8))
        assert targets.tolist() == list(range(5 * index + 1, 5 * index + 9))
    with pytest.raises(IndexError):
        windows[len(windows)]
    with pytest.raises(ValueError, match="cannot fill one window"):
        WindowDataset(torch.arange(8), seq_len=8, stride=1)


def test_held_out_windows_score_each_character_once(datasets):
    _, val, _ = datasets
    scored = val.scored_ids()
    assert val.stride == val.seq_len
    assert torch.equal(scored, val.ids[1 : 1 + len(scored)])
    assert len(val.ids) - 1 - len(scored) < val.seq_len  # only the last partial window is left out


def test_vocab_round_trips_and_refuses_unknown_characters():
    vocab = CharVocab("hello world")
    assert len(vocab) == 8
    assert vocab.decode(vocab.encode("low door").tolist()) == "low door"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab.encode("xyz")


def test_the_model_maps_ids_to_per_token_logits_with_tied_embeddings(datasets):
    _, _, vocab = datasets
    model = small_model(len(vocab))
    assert model(torch.zeros(3, 32, dtype=torch.int64)).shape == (3, 32, len(vocab))
    assert model(torch.zeros(2, 5, dtype=torch.int64)).shape == (2, 5, len(vocab))
    assert model.head.weight is model.token.weight
    with pytest.raises(ValueError, match="exceed the model's context"):
        model(torch.zeros(1, 33, dtype=torch.int64))


def test_the_model_is_deterministic_under_a_seed(datasets):
    _, _, vocab = datasets
    first, second = small_model(len(vocab), seed=3), small_model(len(vocab), seed=3)
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)


def test_attention_is_causal(datasets):
    train, _, vocab = datasets
    model = small_model(len(vocab)).eval()
    inputs = train[0][0].unsqueeze(0)
    changed = inputs.clone()
    changed[0, 20] = (changed[0, 20] + 1) % len(vocab)
    with torch.no_grad():
        before, after = model(inputs), model(changed)
    assert torch.allclose(before[0, :20], after[0, :20], atol=1e-6)
    assert not torch.allclose(before[0, 20:], after[0, 20:], atol=1e-4)


def test_an_untrained_model_is_about_uniform(datasets):
    train, _, vocab = datasets
    model = small_model(len(vocab))
    inputs, targets = map(torch.stack, zip(*(train[i] for i in range(8))))
    with torch.no_grad():
        loss = lm_loss(model(inputs), targets)
    assert loss.item() == pytest.approx(math.log(len(vocab)), abs=0.15)


def test_a_few_dozen_steps_overfit_one_batch(datasets):
    train, _, vocab = datasets
    model = small_model(len(vocab))
    inputs, targets = map(torch.stack, zip(*(train[i] for i in range(4))))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss = lm_loss(model(inputs), targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_lm_loss_is_the_mean_over_every_token():
    outputs = torch.randn(2, 3, 5)
    targets = torch.randint(5, (2, 3))
    by_token = [torch.nn.functional.cross_entropy(outputs[b, t], targets[b, t])
                for b in range(2) for t in range(3)]
    assert lm_loss(outputs, targets).item() == pytest.approx(torch.stack(by_token).mean().item(), rel=1e-6)


def test_generate_writes_the_asked_number_of_characters_deterministically(datasets):
    _, _, vocab = datasets
    model = small_model(len(vocab)).train()
    text = generate(model, vocab, "The if statement", 50, seed=1)
    assert len(text) == 50 and set(text) <= set(vocab.chars)
    assert generate(model, vocab, "The if statement", 50, seed=1) == text
    assert len(generate(model, vocab, "x" * 40, 10, temperature=0)) == 10  # prompt longer than the context
    assert model.training  # left as it was found


def test_bits_per_char_and_the_unigram_baseline():
    assert bits_per_char(math.log(2)) == pytest.approx(1.0)
    uniform = torch.arange(8).repeat(10)
    assert unigram_bits_per_char(uniform, torch.arange(8), 8) == pytest.approx(3.0)
    skewed = torch.tensor([0] * 90 + [1] * 10)
    assert unigram_bits_per_char(skewed, torch.tensor([0]), 2) < 1.0


def test_the_job_config_takes_overrides_and_rejects_bad_sizes():
    job = load_job(TextLMJob, None, ["--model.layers=1", "--train.epochs=2"])
    assert (job.model.layers, job.train.epochs, job.model.d_model) == (1, 2, 128)
    with pytest.raises(ValueError, match="multiple of heads"):
        TextLMModelConfig(d_model=130, heads=4)

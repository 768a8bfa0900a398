"""Which topic of Python's reference documentation a sentence comes from: a small text
classification task that every install ships (the standard library's ``pydoc_data.topics``), for
fine-tuning a Hugging Face encoder. The tokenizer is word-level, built from the sentences (no
download); samples are tokenized but not padded, so that a collator pads each batch to its own
longest sentence (transformers' DataCollatorWithPadding).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Tuple

import torch

TOPICS = ("specialnames", "compound", "types", "debugger")  # the four with most sentences: ~1,270


def labelled_sentences() -> List[Tuple[str, int]]:
    """(sentence, topic index) of every sentence of the four topics, in a fixed order."""
    from pydoc_data.topics import topics
    found = []
    for label, topic in enumerate(TOPICS):
        for sentence in re.split(r"(?<=[.!?])\s+", topics[topic]):
            words = sentence.split()
            if len(words) >= 3:  # headings and fragments say nothing of their topic
                found.append((" ".join(words), label))
    return found


def word_tokenizer(texts: List[str]):
    """A word-level tokenizer over ``texts``' words (lower-cased, punctuation apart), with [PAD] and [UNK]."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    words = sorted({word for text in texts for word in re.findall(r"\w+|[^\w\s]", text.lower())})
    vocabulary = {"[PAD]": 0, "[UNK]": 1, **{word: index + 2 for index, word in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def topic_datasets(max_length: int = 48, val_fraction: float = 0.2, split_seed: int = 0):
    """(tokenizer, train, val): lists of {"input_ids", "attention_mask", "labels"}, unpadded, each
    sentence cut at ``max_length`` tokens; the split is fixed by ``split_seed``."""
    samples = labelled_sentences()
    tokenizer = word_tokenizer([text for text, _ in samples])
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(split_seed)).tolist()
    encoded: List[Dict[str, Any]] = []
    for index in order:
        text, label = samples[index]
        encoded.append({**tokenizer(text, truncation=True, max_length=max_length), "labels": label})
    held_out = int(round(len(encoded) * val_fraction))
    return tokenizer, encoded[held_out:], encoded[:held_out]


def small_classifier(vocab_size: int, seed: int = 0):
    """A 2-layer BERT of width 64 for the four topics, initialized from ``seed``."""
    from transformers import BertConfig, BertForSequenceClassification
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(vocab_size=vocab_size, hidden_size=64, num_hidden_layers=2,
                                                    num_attention_heads=4, intermediate_size=128,
                                                    max_position_embeddings=64, num_labels=len(TOPICS)))

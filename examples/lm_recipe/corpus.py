"""The recipe's data: the standard library's reference text (pydoc_data.topics, in every install) cut
into paragraphs, its last tenth held out; a byte-level BPE tokenizer trained on the rest with Hugging
Face ``tokenizers``; the training paragraphs as a streamed ``datasets`` dataset, tokenized as it is
read; and the unigram baseline a language model has to beat.

Swap ``paragraphs()`` and ``training_stream()`` for your corpus (``load_dataset(..., streaming=True)``)
and the rest of the recipe stays as it is.
"""
from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Iterator, List, Tuple

import torch

from hvdtrain.examples.textlm import load_corpus

END_OF_TEXT = "<|endoftext|>"  # the tokenizer's one special token: padding of packed rows, and generation's end


def paragraphs(val_fraction: float) -> Tuple[List[str], List[str]]:
    """(training paragraphs, held-out paragraphs): the text's last ``val_fraction`` of characters is
    held out (a split by position, as train_lm.py's), each part cut at blank lines."""
    text = load_corpus()
    cut = len(text) - int(round(len(text) * val_fraction))

    def split(part: str) -> List[str]:
        return [paragraph.strip() for paragraph in re.split(r"\n\s*\n", part) if paragraph.strip()]
    return split(text[:cut]), split(text[cut:])


def train_tokenizer(texts: List[str], vocab_size: int, directory: Path):
    """A byte-level BPE (GPT-2's scheme: any text encodes, no unknown token) of ``vocab_size`` tokens
    learnt from ``texts``, saved in ``directory`` as save_pretrained writes it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=END_OF_TEXT, bos_token=END_OF_TEXT,
                                      pad_token=END_OF_TEXT)
    wrapped.save_pretrained(directory)
    return wrapped


def load_tokenizer(directory: Path):
    from transformers import AutoTokenizer

    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{directory} holds no tokenizer.json: run the recipe's tokenizer step (rank 0 trains "
                                f"it when data.tokenizer_dir has none), or point data.tokenizer_dir at its directory")
    return AutoTokenizer.from_pretrained(directory)


def training_stream(texts: List[str], tokenizer, seed: int, shuffle_buffer: int):
    """``texts`` as a streamed ``datasets.IterableDataset`` of {"input_ids"}, shuffled through a buffer
    and tokenized as it is read. Its order follows ``seed`` and the epoch (hvdtrain calls set_epoch), so
    every rank reads the same stream and keeps its own rows."""
    from datasets import IterableDataset

    def read(shards: List[str]) -> Iterator[dict]:
        for text in shards:
            yield {"text": text}
    # A list in gen_kwargs is split into the stream's shards, which shuffle() reorders per epoch too.
    stream = IterableDataset.from_generator(read, gen_kwargs={"shards": texts})
    stream = stream.shuffle(seed=seed, buffer_size=shuffle_buffer)
    return stream.map(lambda batch: {"input_ids": tokenizer(batch["text"])["input_ids"]}, batched=True,
                      remove_columns=["text"])


def scored_targets(rows) -> torch.Tensor:
    """The tokens packed rows score: each label after the first of its row that is not -100 (a causal
    LM scores position t on labels[t + 1])."""
    labels = torch.stack([row["labels"] for row in rows])[:, 1:]
    return labels[labels != -100]


def unigram_perplexity(train_ids: torch.Tensor, targets: torch.Tensor, vocab_size: int) -> float:
    """The perplexity of ``targets`` under the training tokens' frequencies (add-one smoothed): a model
    that ignores all context, over the same tokenizer."""
    counts = torch.bincount(train_ids, minlength=vocab_size).double() + 1
    log_probs = torch.log(counts / counts.sum())
    return math.exp(float(-log_probs[targets].mean()))

"""``hvdtrain bench packing``: what packing documents into rows (hvdtrain.data.packing) gains over
padding them, on a small Hugging Face Llama in one process.

The documents have lognormal lengths (most short, a few long: as tokenized web text), and the same
documents go through both ways, once per pass: packed, rows of ``--row-length`` tokens,
``--batch`` rows a step; padded, ``--batch`` documents a step (in the documents' order) padded to
the longest of the step, as DataCollatorWithPadding does, with an attention mask. A document longer
than a row is cut into row-sized pieces in both, so both train the same tokens. Every step is a
forward, a backward and an AdamW step. The figure is real tokens/s: the documents' tokens (padding
excluded) over the pass's time. The two ways take turns, pass by pass (packed first, then padded
first, ...); the table gives each way's median over its passes, with the padding it carries, and
the speed-up: packed over padded tokens/s paired within each round (the two passes side by side,
under the same load from other jobs), its median and range over the rounds.
"""
from __future__ import annotations

import argparse
import time
from typing import Any, Dict, List

from hvdtrain.bench.common import report
from hvdtrain.bench.common.stats import summarize
from hvdtrain.common.tables import format_table

WAYS = ("packed", "padded")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", type=int, default=128, help="documents per pass (default: 128)")
    parser.add_argument("--median-length", type=float, default=32.0,
                        help="the documents' median length in tokens; lengths are lognormal (default: 32)")
    parser.add_argument("--sigma", type=float, default=1.0,
                        help="the spread of the lognormal lengths: larger is more skewed (default: 1.0)")
    parser.add_argument("--row-length", type=int, default=128,
                        help="tokens per packed row; a longer document is cut into pieces of this length, both ways (default: 128)")
    parser.add_argument("--batch", type=int, default=8, help="rows (packed) or documents (padded) per step (default: 8)")
    parser.add_argument("--hidden", type=int, default=128, help="the Llama's hidden size (default: 128)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads; 2 key/value heads (default: 4)")
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (default: 256)")
    parser.add_argument("--passes", type=int, default=5, help="timed passes per way, after one untimed (default: 5)")
    parser.add_argument("--seed", type=int, default=0, help="the model's and the documents' seed (default: 0)")
    parser.add_argument("--out", help="output directory (default bench-results/packing-<time>)")


def documents(args: argparse.Namespace) -> List[Any]:
    """The documents: lognormal lengths (at least 2 tokens), random token ids (0 is the padding)."""
    import math

    import torch

    generator = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.empty(args.documents).log_normal_(math.log(args.median_length), args.sigma, generator=generator)
    return [torch.randint(1, args.vocab, (max(2, int(length)),), generator=generator) for length in lengths]


def packed_batches(docs: List[Any], args: argparse.Namespace) -> List[Dict[str, Any]]:
    import torch

    from hvdtrain.data.packing import pack_documents

    rows = list(pack_documents(docs, args.row_length))
    return [{key: torch.stack([row[key] for row in rows[i:i + args.batch]]) for key in rows[0]}
            for i in range(0, len(rows), args.batch)]


def padded_batches(docs: List[Any], args: argparse.Namespace) -> List[Dict[str, Any]]:
    """``--batch`` documents (row-sized pieces) a step, right-padded to the step's longest."""
    import torch

    from hvdtrain.data.packing import IGNORE_INDEX

    pieces = [piece for document in docs for piece in torch.split(document, args.row_length)]
    batches = []
    for i in range(0, len(pieces), args.batch):
        chunk = pieces[i:i + args.batch]
        longest = max(len(piece) for piece in chunk)
        input_ids = torch.zeros(len(chunk), longest, dtype=torch.int64)
        attention_mask = torch.zeros_like(input_ids)
        for row, piece in enumerate(chunk):
            input_ids[row, :len(piece)] = piece
            attention_mask[row, :len(piece)] = 1
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return batches


def build_model(args: argparse.Namespace):
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                                      num_key_value_heads=max(1, args.heads // 2),
                                      max_position_embeddings=args.row_length, tie_word_embeddings=True)
    torch.manual_seed(args.seed)
    return transformers.AutoModelForCausalLM.from_config(config)


def measure(args: argparse.Namespace) -> Dict[str, Dict[str, Any]]:
    """Per way: its steps, tokens and padding per pass, and the passes' times."""
    import torch

    from hvdtrain.data.packing import packed_lm_step

    docs = documents(args)
    real = sum(len(document) for document in docs)
    runs: Dict[str, Dict[str, Any]] = {}
    for way, batches in (("packed", packed_batches(docs, args)), ("padded", padded_batches(docs, args))):
        model = build_model(args)
        slots = sum(batch["input_ids"].numel() for batch in batches)
        runs[way] = {"batches": batches, "model": model, "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
                     "steps": len(batches), "real_tokens": real, "token_slots": slots,
                     "padding_share": 1 - real / slots, "pass_s": []}

    def one_pass(run: Dict[str, Any], way: str) -> None:
        model, optimizer = run["model"], run["optimizer"]
        for batch in run["batches"]:
            optimizer.zero_grad()
            loss = packed_lm_step(model, batch)[0] if way == "packed" else model(**batch, use_cache=False).loss
            loss.backward()
            optimizer.step()

    for way, run in runs.items():  # untimed: first-touch allocations
        one_pass(run, way)
    for repeat in range(args.passes):
        for way in (WAYS if repeat % 2 == 0 else WAYS[::-1]):
            started = time.perf_counter()
            one_pass(runs[way], way)
            runs[way]["pass_s"].append(time.perf_counter() - started)
    return {way: {key: value for key, value in run.items() if key not in ("batches", "model", "optimizer")}
            for way, run in runs.items()}


def run(args: argparse.Namespace) -> int:
    if min(args.documents, args.batch, args.passes, args.layers, args.heads) < 1 or args.row_length < 2:
        raise SystemExit("hvdtrain bench packing: --documents, --batch, --passes, --layers and --heads must be >= 1, "
                         "--row-length >= 2")
    if args.median_length <= 0 or args.sigma < 0:
        raise SystemExit("hvdtrain bench packing: --median-length must be > 0 and --sigma >= 0")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise SystemExit("hvdtrain bench packing trains a Hugging Face Llama: pip install transformers") from None
    results = measure(args)
    # The same tokens both ways: tokens/s packed over padded is the padded pass's time over the packed one's.
    speedup = summarize([padded / packed for packed, padded in zip(results["packed"]["pass_s"],
                                                                     results["padded"]["pass_s"])])
    rows: List[list] = []
    for way, result in results.items():
        result["tokens_per_s"] = summarize([result["real_tokens"] / s for s in result["pass_s"]])
        result["pass_s"] = summarize(result["pass_s"])
        paired = speedup if way == "packed" else summarize([1.0])
        rows.append([way, result["steps"], result["real_tokens"], result["token_slots"], result["padding_share"] * 100,
                     result["tokens_per_s"].median, result["tokens_per_s"].spread * 100, paired.median,
                     f"{paired.low:.3g}-{paired.high:.3g}"])
    title = (f"packed rows against padded batches: a Llama (hidden {args.hidden}, {args.layers} layers, {args.heads} "
             f"heads, vocabulary {args.vocab}), {args.documents} documents of lognormal lengths (median "
             f"{args.median_length:g}, sigma {args.sigma:g}), rows of {args.row_length}, batch {args.batch}, one "
             f"process, {args.passes} passes per way taken in turn")
    out = report.output_dir(args.out, "packing")
    path = report.write_json(out / "packing.json", {
        "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab},
        "documents": args.documents, "median_length": args.median_length, "sigma": args.sigma,
        "row_length": args.row_length, "batch": args.batch, "packed_over_padded": speedup.to_dict(),
        "ways": {way: dict(r, tokens_per_s=r["tokens_per_s"].to_dict(), pass_s=r["pass_s"].to_dict())
                 for way, r in results.items()}})
    report.print_lines([format_table(["way", "steps", "real tokens", "token slots", "padding %", "real tokens/s",
                                      "+-%", "x padded", "range"], rows, title), f"wrote {path}"])
    return 0

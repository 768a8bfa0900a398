"""The example transformer and its token data, as the model-parallel and plan benches build them.

Both benches take the model's shape on their command line and build the same model from a seed
on every rank (a pipeline's stages and a tensor group read one batch, so the data is the same
everywhere too). torch is imported inside the functions: the bench drivers import this module's
neighbours without starting torch.
"""
from __future__ import annotations

import argparse
from typing import Dict, List


def add_model_arguments(parser: argparse.ArgumentParser, d_model: int, layers: int) -> None:
    """The model's shape, the same options in a bench's driver and in its worker."""
    parser.add_argument("--vocab", type=int, default=256, help="vocabulary size (default: 256)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default: 64)")
    parser.add_argument("--d-model", type=int, default=d_model, help=f"model width (default: {d_model})")
    parser.add_argument("--layers", type=int, default=layers, help=f"transformer blocks (default: {layers})")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: 4)")


def model_argv(args: argparse.Namespace) -> List[str]:
    """``args``'s model shape as the worker's command-line options (``add_model_arguments``'s)."""
    return [item for key, value in dims(args).items() for item in (f"--{key.replace('_', '-')}", str(value))]


def dims(args: argparse.Namespace) -> Dict[str, int]:
    return {"vocab": args.vocab, "seq_len": args.seq_len, "d_model": args.d_model, "layers": args.layers,
            "heads": args.heads}


def build_model(args: argparse.Namespace):
    """The example transformer of ``args``'s shape, the same weights on every rank (from ``args.seed``)."""
    import torch

    from hvdtrain.examples.textlm import TinyTransformerLM

    torch.manual_seed(args.seed)
    return TinyTransformerLM(args.vocab, seq_len=args.seq_len, d_model=args.d_model, layers=args.layers,
                             heads=args.heads, dropout=0.0)


def token_batch(args: argparse.Namespace, size: int):
    """(inputs, targets): ``size`` windows of random token ids, the same on every rank."""
    import torch

    generator = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (size, args.seq_len + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

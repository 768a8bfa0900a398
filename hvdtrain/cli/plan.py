"""Which strategy and mesh to run, for a model on a cluster: every layout that fits, its memory per
rank and step time (MODELLED, not measured: hvdtrain.planner says how), and the fastest one.

    hvdtrain plan --example textlm --workers 4 --memory 2GiB
    hvdtrain plan --layers 48 --d-model 1600 --seq-len 1024 --vocab 50257 --heads 25 \\
        --batch 512 --workers 64 --memory 40GB --network ib-hdr --gpus-per-node 8 --intra nvlink --precision bf16
    hvdtrain plan --hf qwen2_moe --seq-len 4096 --batch 64 --workers 16 --memory 80GB --precision bf16

A Hugging Face model (``--hf``: a model type of the installed transformers, at its default sizes, or a
directory with a config.json) is built on the meta device and counted: every parameter, and the routed
experts of a mixture of experts (their fused modules, as expert parallelism finds them), so that the
plan also ranks expert-parallel layouts (E). A memory that fits nothing is an error that says the memory per worker and the worker count that would fit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import List, Optional

from hvdtrain.common import units
from hvdtrain.common.tables import format_table
from hvdtrain.common.units import MiB, format_bytes
from hvdtrain import planner
from hvdtrain.planner.network import LABEL, NETWORKS


def parse_bytes(text: str) -> float:
    """'2GiB', '40GB', '512MiB', '1e9' -> bytes."""
    size = units.parse_bytes(text)
    if size is None:
        raise argparse.ArgumentTypeError(f"a memory size like 2GiB, 40GB or 512MiB, not {text!r}")
    return size


HELP = "which strategy and mesh fit this model on this cluster, and the fastest (modelled)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group("the model (--example, or its shape)")
    model.add_argument("--example", choices=["textlm"],
                       help="textlm: hvdtrain.examples.textlm's TinyTransformerLM, default config")
    model.add_argument("--hf", metavar="MODEL",
                       help="a Hugging Face model type (qwen2_moe, mixtral, ...) at its default sizes, or a directory "
                            "with a config.json: counted on the meta device, its experts too")
    for name, text in (("layers", "transformer blocks"), ("d-model", "width"),
                       ("seq-len", "context, tokens (with --hf: default its config's max_position_embeddings)"),
                       ("vocab", "vocabulary size"), ("heads", "attention heads")):
        model.add_argument(f"--{name}", type=int, help=text)
    model.add_argument("--params", type=float,
                       help="parameter count, if not the shape's own (GPT blocks, tied head); the blocks take the difference")
    for name, text in (("experts", "a mixture of experts: routed experts per MoE layer"),
                       ("top-k", "a mixture of experts: experts per token"),
                       ("moe-layers", "a mixture of experts: layers with routed experts (default: every layer)")):
        model.add_argument(f"--{name}", type=int, help=text)
    model.add_argument("--expert-params", type=float,
                       help="a mixture of experts: elements of every layer's routed experts together (part of --params)")
    parser.add_argument("--batch", type=int, default=64, help="global batch, samples per step (default 64)")
    parser.add_argument("--workers", type=int, required=True, help="worker (device) count")
    parser.add_argument("--memory", type=parse_bytes, required=True, help="device memory per worker: 2GiB, 40GB...")
    parser.add_argument("--network", choices=list(NETWORKS), default="25gbe",
                        help="bench project's network presets (default 25gbe)")
    parser.add_argument("--gpus-per-node", type=int, default=1, help="workers per node (default 1)")
    parser.add_argument("--intra", choices=[n for n, v in NETWORKS.items() if v.intra_node], default="pcie3",
                        help="link between the workers of one node (default pcie3)")
    parser.add_argument("--optimizer", choices=list(planner.OPTIMIZERS), default="adam",
                        help="adam (2 state tensors) or sgd with momentum (1); state in fp32 (default adam)")
    parser.add_argument("--precision", choices=list(planner.PRECISIONS), default="fp32",
                        help="parameters, gradients and activations; bf16 adds an fp32 master copy (default fp32)")
    parser.add_argument("--flops", type=float, default=planner.DEFAULT_FLOPS,
                        help=f"FLOP/s one device achieves (default {planner.DEFAULT_FLOPS:.3g}: assumed, not measured)")
    parser.add_argument("--update-bandwidth", type=float, default=planner.DEFAULT_UPDATE_BANDWIDTH,
                        help=f"bytes/s one device's optimizer update streams (default "
                             f"{planner.DEFAULT_UPDATE_BANDWIDTH:.3g}: assumed, not measured)")
    parser.add_argument("--micro-batches", type=int,
                        help="pipeline micro-batches (default: the most, up to 4 x stages, dividing a replica's batch)")
    parser.add_argument("--ps-servers", type=int, default=1, help="strategy ps: server ranks (default 1)")
    parser.add_argument("--fusion-mb", type=float, default=128.0, help="Horovod fusion threshold, MiB (default 128)")
    parser.add_argument("--fsdp-overlap", choices=list(planner.FSDP_UNITS_HELD), default="full",
                        help="train.fsdp_overlap the fsdp and hsdp layouts run with: how many units they hold "
                             "(default full, auto's choice on GPUs)")


MOE_FLAGS = ("experts", "top_k", "moe_layers", "expert_params")


def _shape(args: argparse.Namespace) -> planner.ModelShape:
    given = {name: getattr(args, name) for name in ("layers", "d_model", "seq_len", "vocab", "heads")}
    moe = {name: getattr(args, name, None) for name in MOE_FLAGS}
    if args.example and args.hf:
        raise ValueError("give --example or --hf, not both")
    if args.example or args.hf:
        allowed = {"seq_len"} if args.hf else set()
        extra = [f"--{name.replace('_', '-')}" for name, value in {**given, **moe, "params": args.params}.items()
                 if value is not None and name not in allowed]
        if extra:
            raise ValueError(f"give --{'hf' if args.hf else 'example'} or the model's shape, not both "
                             f"({', '.join(extra)} given)")
        if args.hf:
            return hf_shape(args.hf, given["seq_len"])
        from hvdtrain.examples.textlm import planner_shape  # torch: only for --example

        return planner_shape()
    missing = [f"--{name.replace('_', '-')}" for name, value in given.items() if value is None]
    if missing:
        raise ValueError(f"give --example textlm, --hf MODEL, or the model's shape: missing {', '.join(missing)}")
    if any(value is not None for value in moe.values()):
        absent = [f"--{name.replace('_', '-')}" for name, value in moe.items() if value is None and name != "moe_layers"]
        if absent or args.params is None:
            raise ValueError(f"a mixture of experts needs --experts, --top-k, --expert-params and --params (the whole "
                             f"count): missing {', '.join(absent + ([] if args.params is not None else ['--params']))}")
        moe["moe_layers"] = given["layers"] if moe["moe_layers"] is None else moe["moe_layers"]
        return planner.ModelShape(**given, params=args.params, **moe)
    return planner.ModelShape(**given, params=args.params)


def hf_shape(model: str, seq_len: Optional[int] = None) -> planner.ModelShape:
    """A Hugging Face model's shape as the planner models it, counted on the meta device: every
    parameter once, and the routed experts of every fused experts module (hvdtrain.parallel.experts
    finds them as expert parallelism splits them; a shared expert and the router are the rest).

    Args:
        model: a model type of the installed transformers (its default sizes) or a directory with a config.json.
        seq_len: the context trained on (default: the config's max_position_embeddings).
    """
    import torch  # torch and transformers: only for --hf
    try:
        import transformers
    except ImportError as error:
        raise ValueError("--hf needs transformers: pip install -e '.[hf]'") from error
    from hvdtrain.parallel.experts import TOP_K_KEYS, experts_per_token, fused_experts

    if Path(model).is_dir():
        if not (Path(model) / "config.json").is_file():
            raise ValueError(f"--hf {model}: the directory has no config.json (give a Hugging Face model directory)")
        config = transformers.AutoConfig.from_pretrained(model)
    else:
        try:
            config = transformers.AutoConfig.for_model(model)
        except ValueError as error:
            raise ValueError(f"--hf {model}: neither a directory nor a model type of transformers "
                             f"{transformers.__version__} ({error})") from None
    config = getattr(config, "text_config", None) or config
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in built.parameters())  # parameters() yields a tied matrix once
    experts = fused_experts(built)
    sizes = {module.num_experts for module in experts.values()}
    if len(sizes) > 1:
        raise ValueError(f"--hf {model}: MoE layers with different expert counts ({sorted(sizes)}): the planner "
                         f"models one count per layer")
    context = seq_len or getattr(config, "max_position_embeddings", None)
    if not context:
        raise ValueError(f"--hf {model}: its config has no max_position_embeddings: give --seq-len")
    moe = {}
    if experts:
        top_k = experts_per_token(config)
        if top_k is None:
            raise ValueError(f"--hf {model}: its config names no experts per token ({', '.join(TOP_K_KEYS)})")
        moe = dict(experts=sizes.pop(), top_k=top_k, moe_layers=len(experts),
                   expert_params=float(sum(p.numel() for module in experts.values()
                                           for p in module.parameters(recurse=False))))
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return planner.ModelShape(config.num_hidden_layers, config.hidden_size, context, config.vocab_size,
                              config.num_attention_heads, params=float(total), kv_heads=kv_heads, **moe)


def setup_from(args: argparse.Namespace) -> planner.Setup:
    return planner.Setup(_shape(args), args.batch, args.memory, args.workers, args.network, args.optimizer,
                      args.precision, args.flops, args.micro_batches, args.gpus_per_node, args.intra,
                      args.ps_servers, args.fusion_mb * MiB, update_bandwidth=args.update_bandwidth,
                      fsdp_overlap=args.fsdp_overlap)


def table_lines(result: planner.Plan) -> List[str]:
    setup, shape = result.setup, result.setup.shape
    rows = [[e.layout.strategy + (f" K={e.layout.shard}" if e.layout.shard else ""), e.layout.tensor, e.layout.pipeline, e.layout.sequence, e.layout.experts, e.layout.data,
             e.layout.micro_batches,
             e.states / MiB, e.activations / MiB, e.total / MiB, e.step_s * 1e3, e.samples_per_s]
            for e in result.fitting]
    title = (f"{LABEL}: {planner.format_count(shape.total)} parameters ({shape.layers} layers, d_model {shape.d_model}, "
             f"seq {shape.seq_len}, vocab {shape.vocab}, heads {shape.heads}{_experts_text(shape)}), {setup.optimizer}, "
             f"{setup.precision}, "
             f"global batch {setup.batch}, {setup.workers} workers x {format_bytes(setup.memory)}, {setup.network}, "
             f"{setup.flops / 1e12:.3g} TFLOP/s and an update at {setup.update_bandwidth / 1e12:.3g} TB/s per device "
             f"(assumed). Layouts that fit, fastest first:")
    headers = ["strategy", "T", "P", "S", "E", "D", "M", "params+grads+state MiB (modelled)", "activations MiB (modelled)",
               "total MiB (modelled)", "step ms (modelled)", "samples/s (modelled)"]
    lines = [format_table(headers, rows, title)]
    if result.too_big:
        lines.append("do not fit: " + ", ".join(f"{e.layout.name} ({format_bytes(e.total)})"
                                                 for e in sorted(result.too_big, key=lambda e: e.total)))
    best = result.recommended.layout
    lines += [f"recommended (modelled): {best.name}: {result.why()}",
              _how_to_run(best, setup.batch)]
    return lines


def _experts_text(shape: planner.ModelShape) -> str:
    if not shape.experts:
        return ""
    return (f"; {shape.experts} experts, top-{shape.top_k}, in {shape.moe_layers} layers: "
            f"{planner.format_count(shape.expert_params)} parameters")


def _how_to_run(layout: planner.Layout, batch: int) -> str:
    flags = [f"--train.strategy={layout.strategy}", f"--train.batch_size={batch // layout.data}"]
    if layout.tensor > 1:
        flags.append(f"--train.tensor_parallel={layout.tensor}")
    if layout.pipeline > 1:
        flags += [f"--train.pipeline_parallel={layout.pipeline}", f"--train.micro_batches={layout.micro_batches}"]
    if layout.sequence > 1:
        flags.append(f"--train.sequence_parallel={layout.sequence}")
    if layout.experts > 1:
        flags.append(f"--train.expert_parallel={layout.experts}")
    return "  run with: " + " ".join(flags)


def run(args: argparse.Namespace) -> int:
    try:
        result = planner.make_plan(setup_from(args))
    except ValueError as error:  # NothingFits included
        print(f"hvdtrain plan: {error}", file=sys.stderr)
        return 2
    print("\n".join(table_lines(result)), flush=True)
    return 0

"""A language model end to end, as for a model too big for one GPU: a byte-level BPE tokenizer, a streamed
and packed ``datasets`` dataset, a Llama built on the meta device and trained under fsdp + bf16 +
activation checkpointing with sharded, asynchronous checkpoints; preemptible (SIGUSR1, or SIGTERM as
SLURM's GraceTime sends it) and resumed by running it again; evaluated against a unigram baseline;
exported to a Hugging Face directory that ``from_pretrained`` and ``pipeline("text-generation")`` load.

    horovodrun -np 2 python examples/lm_recipe/train_llama.py
    horovodrun -np 2 python examples/lm_recipe/train_llama.py --train.max_steps=40 --model.layers=2   # shorter
    sbatch slurm/lm_recipe.sbatch                                                              # GPUs

Its step by step, with the figures of a run: docs/how-to/lm-recipe.md. Needs the hf extra
(pip install -e '.[hf]': transformers, tokenizers, datasets).
"""
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

import hvdtrain
from hvdtrain.config.checks import check_whole_numbers
from hvdtrain.data.packing import causal_lm_loss
from hvdtrain.distributed import collectives
from hvdtrain.examples.hf_lm import build_on_meta, describe

from corpus import load_tokenizer, paragraphs, scored_targets, train_tokenizer, training_stream, unigram_perplexity

PROMPT = "The if statement"


@dataclass
class RecipeData:
    """The text, its tokenizer and the rows it is packed into."""

    tokenizer_dir: str = field(default="runs/lm_recipe/tokenizer", metadata={"help": "where the BPE tokenizer is trained to (rank 0, when absent) and read from: a resume must tokenize alike"})
    vocab_size: int = field(default=4096, metadata={"help": "BPE tokens, the end-of-text token included"})
    row_length: int = field(default=256, metadata={"help": "tokens per packed row (the model's context)"})
    val_fraction: float = field(default=0.1, metadata={"help": "share of the text, at its end, held out"})
    shuffle_buffer: int = field(default=256, metadata={"help": "paragraphs in the stream's shuffle buffer"})

    def __post_init__(self) -> None:
        check_whole_numbers(self, ("vocab_size", "row_length", "shuffle_buffer"))
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"RecipeData.val_fraction must be between 0 and 1, got {self.val_fraction}")


@dataclass
class RecipeModel:
    """The Llama's sizes (LlamaConfig's names in parentheses)."""

    hidden: int = field(default=256, metadata={"help": "hidden size (hidden_size)"})
    layers: int = field(default=4, metadata={"help": "decoder layers (num_hidden_layers)"})
    heads: int = field(default=8, metadata={"help": "query heads (num_attention_heads)"})
    kv_heads: int = field(default=4, metadata={"help": "key/value heads (num_key_value_heads)"})
    intermediate: int = field(default=704, metadata={"help": "the MLP's hidden size (intermediate_size)"})

    def __post_init__(self) -> None:
        check_whole_numbers(self, ("hidden", "layers", "heads", "kv_heads", "intermediate"))
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"RecipeModel: heads ({self.heads}) must divide hidden ({self.hidden}) and kv_heads "
                             f"({self.kv_heads}) must divide heads")


@dataclass
class LlamaRecipeJob:
    """train_llama.py's settings: --section.key=value overrides (or a YAML file with --config)."""

    # A stream has no length: max_steps ends the run and the warm-up is counted in steps. The rate is
    # one worker's, scaled by the worker count (train.scale_lr; false keeps it as it is).
    train: hvdtrain.TrainConfig = field(default_factory=lambda: hvdtrain.TrainConfig(
        epochs=100, max_steps=300, batch_size=8, lr=1e-3, warmup_steps=30, lr_schedule="cosine", min_lr_ratio=0.1,
        max_grad_norm=1.0, strategy="fsdp", precision="bf16", activation_checkpointing="full",
        checkpoint_dir="runs/lm_recipe/checkpoints", checkpoint_every=50, checkpoint_format="sharded",
        checkpoint_async=True, preempt_on_term=True, preempt_check_every=5, eval_every=100, log_every=10,
        run_dir="runs/lm_recipe"))
    model: RecipeModel = field(default_factory=RecipeModel)
    data: RecipeData = field(default_factory=RecipeData)


def tokenizer_step(data: RecipeData, texts, world):
    """Rank 0 trains the tokenizer unless data.tokenizer_dir has one; every rank then reads that one."""
    directory = Path(data.tokenizer_dir)
    if world.is_root and not (directory / "tokenizer.json").is_file():
        train_tokenizer(texts, data.vocab_size, directory)
        print(f"tokenizer: byte-level BPE of {data.vocab_size} tokens trained into {directory}", flush=True)
    collectives.barrier()  # written before any rank reads it
    return load_tokenizer(directory)


def llama_config(model: RecipeModel, data: RecipeData, tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tokenizer), hidden_size=model.hidden, intermediate_size=model.intermediate,
                       num_hidden_layers=model.layers, num_attention_heads=model.heads,
                       num_key_value_heads=model.kv_heads, max_position_embeddings=data.row_length,
                       tie_word_embeddings=False, bos_token_id=tokenizer.eos_token_id,
                       eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)


@torch.no_grad()
def perplexity(model, rows, batch_size: int = 16) -> float:
    """exp(mean cross-entropy) over every scored token of the packed ``rows`` (each document alone)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, len(rows), batch_size):
        batch = {key: torch.stack([row[key] for row in rows[start:start + batch_size]]).to(device) for key in rows[0]}
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        scored = int((batch["labels"][:, 1:] != -100).sum())
        total += float(causal_lm_loss(logits.double(), batch["labels"])) * scored
        count += scored
    return math.exp(total / count)


def report(trainer, hf_config, tokenizer, val_rows, train_ids, run_dir) -> None:
    """Rank 0: perplexity against the unigram baseline, the probe logits the export must reproduce, and a
    sample from the exported directory through transformers' own pipeline. The model is made whole on
    every rank and scored on rank 0's device: fine while it fits one device (see docs/how-to/lm-recipe.md)."""
    from transformers import LlamaForCausalLM, pipeline

    whole = trainer.strategy.exported_model_state()  # a collective: under fsdp every rank gathers
    if not trainer.world.is_root:
        return
    with torch.device(trainer.world.device):
        model = LlamaForCausalLM(hf_config)
    model.load_state_dict(whole)
    model.eval()
    baseline = unigram_perplexity(train_ids, scored_targets(val_rows), len(tokenizer))
    print(f"validation perplexity {perplexity(model, val_rows):.2f} over {len(scored_targets(val_rows))} held-out "
          f"tokens (unigram baseline over the same tokenizer: {baseline:.2f})", flush=True)
    probe = val_rows[0]["input_ids"][None, :32]
    with torch.no_grad():  # in float64 on the CPU: what a test compares the export's logits to
        logits = model.to("cpu", torch.float64)(input_ids=probe, use_cache=False).logits
    torch.save({"input_ids": probe, "logits": logits}, run_dir / "probe_logits.pt")
    del model, whole
    exported = run_dir / "hf"
    tokenizer.save_pretrained(exported)  # beside the weights: the directory is all a user loads
    generator = pipeline("text-generation", model=str(exported), device=trainer.world.device)
    text = generator(PROMPT, max_new_tokens=40, do_sample=True, top_k=40, temperature=0.8)[0]["generated_text"]
    print(f"sample: {text!r}", flush=True)


def main(argv=None) -> int:
    parser = hvdtrain.job_argument_parser(LlamaRecipeJob, __doc__)
    job, _ = hvdtrain.parse_job(LlamaRecipeJob, parser, argv)
    if job.train.run_dir is None:
        parser.error("train.run_dir is null: the recipe exports the model into its run directory, give one")
    world = hvdtrain.init(job.train)  # Horovod started as the settings need it; device, threads, seeds
    train_texts, val_texts = paragraphs(job.data.val_fraction)
    tokenizer = tokenizer_step(job.data, train_texts, world)
    pad = tokenizer.eos_token_id
    # Rows of whole global batches, packed as the stream is read; the held-out rows packed once.
    train_rows = hvdtrain.packed(training_stream(train_texts, tokenizer, job.train.seed, job.data.shuffle_buffer),
                                 job.data.row_length, pad_id=pad)
    val_rows = list(hvdtrain.packed(tokenizer(val_texts)["input_ids"], job.data.row_length, pad_id=pad).rows)
    hf_config = llama_config(job.model, job.data, tokenizer)
    model = build_on_meta(hf_config)  # no memory: fsdp gives each rank its shard's values
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.train.lr, weight_decay=0.1)
    trainer = hvdtrain.Trainer(model, optimizer, train_rows, val_rows, job.train, world=world,
                               step_fn=hvdtrain.packed_lm_step, job_config=hvdtrain.to_dict(job))
    if world.is_root:
        print(f"model: {describe(hf_config)}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
              f"rows of {job.data.row_length} tokens", flush=True)
    run_dir = trainer.parts.reporter.path  # rank 0's (the others write none); closed by run()
    final = trainer.run()  # None: preempted, checkpointed (and requeued under SLURM); run again to resume
    if final is None:
        return 0
    train_ids = torch.cat([torch.tensor(ids) for ids in tokenizer(train_texts)["input_ids"]])
    report(trainer, hf_config, tokenizer, val_rows, train_ids, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())

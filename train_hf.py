"""Train a Hugging Face causal LM (Llama, Qwen2, Qwen3 or Mistral) on the shipped text, under any
strategy or tensor-parallel layout with one flag.

    horovodrun -np 2 python train_hf.py                                   # ddp, a small Llama
    horovodrun -np 2 python train_hf.py --train.strategy=fsdp             # never whole on any rank
    horovodrun -np 2 python train_hf.py --train.tensor_parallel=2         # split by the model's own tp_plan
    horovodrun -np 4 python train_hf.py --train.pipeline_parallel=2 --train.tensor_parallel=2
    horovodrun -np 2 python train_hf.py --model.family=qwen3 --model.layers=4
    horovodrun -np 2 python train_hf.py --model.pretrained=runs/run/hf    # start from a directory's weights

The model is built on the meta device and initialized by the Trainer (or loaded), the text is the
standard library's pydoc_data.topics, one token per character (hvdtrain.examples.textlm). At the end
the run directory holds hf/, which transformers' from_pretrained loads. Needs transformers
(pip install -e '.[hf]').
"""
import sys

import torch

import hvdtrain
from hvdtrain.examples.hf_lm import HFLMJob, build_on_meta, causal_lm_loss, describe, model_config
from hvdtrain.examples.textlm import bits_per_char, load_text_datasets, unigram_bits_per_char


def main(argv=None) -> int:
    parser = hvdtrain.job_argument_parser(HFLMJob, __doc__)
    parser.add_argument("--require-bpc", type=float, default=None,
                        help="exit 1 unless the final validation bits/char is at most this")
    job, args = hvdtrain.parse_job(HFLMJob, parser, argv)
    config = job.train
    world = hvdtrain.init(config)  # the world these settings need (seed, timeline, process sets, ...)
    train_set, val_set, vocab = load_text_datasets(job.model.seq_len, job.data.train_stride, job.data.val_fraction)
    hf_config, source = model_config(job.model, len(vocab))
    model = build_on_meta(hf_config)
    # The script's own rate; --train.lr (default 0.001, HFLMJob) replaces it, the Trainer scales it.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.001)
    trainer = hvdtrain.Trainer(model, optimizer, train_set, val_set, config, loss_fn=causal_lm_loss,
                               world=world, job_config=hvdtrain.to_dict(job))
    if world.is_root:
        print(f"model: {describe(hf_config)}, from {source}", flush=True)
    if job.model.pretrained and not trainer.global_step:  # a resumed run continues from its checkpoint instead
        trainer.load_pretrained(job.model.pretrained)
    final = trainer.run()  # None: preempted, checkpointed (and requeued under SLURM); a restart resumes
    if final is None:
        return 0
    world = trainer.world

    bpc = bits_per_char(final["val_loss"])  # every rank holds the all-reduced loss: the same exit code
    if world.is_root:
        baseline = unigram_bits_per_char(train_set.ids, val_set.scored_ids(), len(vocab))
        print(f"final validation loss {final['val_loss']:.4f} nats/char = {bpc:.3f} bits/char on "
              f"{int(final['val_samples']) * job.model.seq_len} held-out characters, {world.size} "
              f"worker{'s' if world.size > 1 else ''} (unigram baseline: {baseline:.3f} bits/char)", flush=True)
    if args.require_bpc is not None and not bpc <= args.require_bpc:
        if world.is_root:
            print(f"error: {bpc:.3f} bits/char is above the required {args.require_bpc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

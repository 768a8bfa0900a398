"""Train a small character-level transformer on Python's own reference text, data-parallel.

    horovodrun -np 2 python train_lm.py
    mpirun -np 2 --hostfile hostfiles/localhost python train_lm.py
    python train_lm.py --train.epochs=1 --model.layers=1      # one process, no launcher
    horovodrun -np 4 python train_lm.py --train.tensor_parallel=2 --train.pipeline_parallel=2

The text is the standard library's pydoc_data.topics (no download); its last 10% is held out.
Same structure as train.py: only the data, the model, the loss and the optimizer differ.
"""
import dataclasses
import sys

import torch

import hvdtrain
from hvdtrain.examples.textlm_parallel import pipeline_layers, tensor_plan
from hvdtrain.examples.textlm import (TextLMJob, TinyTransformerLM, bits_per_char, generate, lm_loss,
                                      load_text_datasets, unigram_bits_per_char)

PROMPT = "The if statement"


def main(argv=None) -> int:
    parser = hvdtrain.job_argument_parser(TextLMJob, __doc__)
    parser.add_argument("--require-bpc", type=float, default=None,
                        help="exit 1 unless the final validation bits/char is at most this")
    job, args = hvdtrain.parse_job(TextLMJob, parser, argv)
    config = job.train

    world = hvdtrain.init(config)  # the world these settings need (seed, timeline, process sets, ...)
    train_set, val_set, vocab = load_text_datasets(job.model.seq_len, job.data.train_stride,
                                                   job.data.val_fraction)
    model = TinyTransformerLM(len(vocab), **dataclasses.asdict(job.model))
    # The script's own rate; --train.lr (configs/textlm.yaml: 0.001) replaces it, the Trainer scales it.
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    # How the transformer splits under --train.tensor_parallel / --train.pipeline_parallel.
    trainer = hvdtrain.Trainer(model, optimizer, train_set, val_set, config, loss_fn=lm_loss,
                               world=world, job_config=hvdtrain.to_dict(job),
                               model_plan=hvdtrain.ModelPlan(tensor_plan=tensor_plan(model),
                                                             pipeline_layers=pipeline_layers))
    final = trainer.run()  # None: preempted, checkpointed (and requeued under SLURM); a restart resumes
    if final is None:
        return 0
    world = trainer.world  # under Horovod elastic, the world at the end may not be the one at the start

    # Every rank holds the same, all-reduced loss, so every rank exits with the same code.
    bpc = bits_per_char(final["val_loss"])
    # The sample comes from the whole model: a collective (fsdp and a mesh gather it; ddp has it).
    whole_state = trainer.strategy.exported_model_state()
    if world.is_root:
        baseline = unigram_bits_per_char(train_set.ids, val_set.scored_ids(), len(vocab))
        print(f"final validation loss {final['val_loss']:.4f} nats/char = {bpc:.3f} bits/char on "
              f"{int(final['val_samples']) * job.model.seq_len} held-out characters, {world.size} "
              f"worker{'s' if world.size > 1 else ''} (unigram baseline: {baseline:.3f} bits/char)",
              flush=True)
        model = trainer.model
        if config.model_parallel:  # each rank held a part: sample from the whole trained model
            model = TinyTransformerLM(len(vocab), **dataclasses.asdict(job.model))
            model.load_state_dict(whole_state)
        print(f"sample: {PROMPT + generate(model, vocab, PROMPT, 160)!r}", flush=True)
    if args.require_bpc is not None and not bpc <= args.require_bpc:
        if world.is_root:
            print(f"error: {bpc:.3f} bits/char is above the required {args.require_bpc}",
                  file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

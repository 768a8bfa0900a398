"""Train a small CNN on the 8x8 digits, data-parallel over every rank of the launch.

    horovodrun -np 2 python train.py
    mpirun -np 2 --hostfile hostfiles/localhost python train.py --config configs/digits.yaml
    python train.py --train.epochs=5 --model.hidden=64      # one process, no launcher

Copy this file for your own job: build the data, the model and the optimizer as for one
process (with one worker's learning rate); hvdtrain does the distribution.
"""
import sys

import torch

import hvdtrain
from hvdtrain.examples.digits import DigitsCNN, DigitsJob, load_digits_datasets


def main(argv=None) -> int:
    parser = hvdtrain.job_argument_parser(DigitsJob, __doc__)
    parser.add_argument("--require-accuracy", type=float, default=None,
                        help="exit 1 unless the final validation accuracy reaches this fraction")
    job, args = hvdtrain.parse_job(DigitsJob, parser, argv)
    config = job.train

    world = hvdtrain.init(config)  # the world these settings need (seed, timeline, process sets, ...)
    dtype = job.model.torch_dtype
    train_set, val_set = load_digits_datasets(job.data.val_fraction, job.data.split_seed, dtype)
    model = DigitsCNN(channels=job.model.channels, hidden=job.model.hidden).to(dtype)
    # The script's own rate; --train.lr (configs/digits.yaml: 0.02) replaces it, the Trainer scales it.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    trainer = hvdtrain.Trainer(model, optimizer, train_set, val_set, config, world=world,
                               job_config=hvdtrain.to_dict(job))
    final = trainer.run()  # None: preempted, checkpointed (and requeued under SLURM); a restart resumes
    if final is None:
        return 0
    world = trainer.world  # under Horovod elastic, the world at the end may not be the one at the start

    # Every rank holds the same, all-reduced accuracy, so every rank exits with the same code.
    accuracy = final["val_accuracy"]
    if world.is_root:
        print(f"final validation accuracy: {accuracy:.4f} on {int(final['val_samples'])} "
              f"held-out digits, {world.size} worker{'s' if world.size > 1 else ''}", flush=True)
    if args.require_accuracy is not None and accuracy < args.require_accuracy:
        if world.is_root:
            print(f"error: accuracy {accuracy:.4f} is below the required {args.require_accuracy}",
                  file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

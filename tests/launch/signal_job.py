"""A tiny Trainer job for the launcher's signals and the refusals, at 2 ranks.

    hvdtrain launch -np 2 -- python tests/launch/signal_job.py CASE DIRECTORY [--train.key=value ...]

CASE is one of:
    train                 trains (checkpointing into DIRECTORY/ckpt) until preempted, or for ever; rank 0
                          writes DIRECTORY/stepped after its 3rd step, so that a test knows when to signal
    resume_false          writes a checkpoint, then starts a run with train.resume=false over it
    missing_pretrained    starts from DIRECTORY/absent's pretrained weights (there are none)
    bad_layout            pipeline_parallel=3 at 2 ranks: no mesh fits
    bad_layout_late_root  the same, rank 0 reaching the refusal 3 s after rank 1 (as under load)

Refusals are not caught here: the script ends as any user's script would.
"""
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

import hvdtrain
from hvdtrain.config.train import TrainConfig


@dataclass
class Job:
    train: TrainConfig = field(default_factory=lambda: TrainConfig(epochs=1000, batch_size=4, log_every=1000,
                                                                   warmup_epochs=0.0, preempt_check_every=1))


class MarkAfterThreeSteps(hvdtrain.Callback):
    def __init__(self, path: Path) -> None:
        self.path = path

    def on_step_end(self, trainer, step: int) -> None:
        if step == 3 and trainer.world.is_root:
            self.path.touch()


def trainer_for(config: TrainConfig, world, callbacks=()):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = torch.nn.Linear(4, 2)
    return hvdtrain.Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), data, None, config, world=world,
                            callbacks=callbacks)


def main() -> int:
    case, directory = sys.argv[1], Path(sys.argv[2])
    parser = hvdtrain.job_argument_parser(Job, __doc__)
    job, _ = hvdtrain.parse_job(Job, parser, sys.argv[3:])
    config = replace(job.train, checkpoint_dir=str(directory / "ckpt"))
    world = hvdtrain.init(seed=config.seed)
    if case == "train":
        final = trainer_for(config, world, [MarkAfterThreeSteps(directory / "stepped")]).run()
        return 0 if final is None else 1  # preempted: 0, as train.py
    if case == "resume_false":
        first = trainer_for(replace(config, max_steps=2), world)
        first.run()
        trainer_for(replace(config, max_steps=4, resume="false"), world)
    elif case == "missing_pretrained":
        trainer_for(config, world).load_pretrained(directory / "absent")
    elif case in ("bad_layout", "bad_layout_late_root"):
        if case == "bad_layout_late_root" and world.is_root:
            time.sleep(3)
        trainer_for(replace(config, checkpoint_dir=None, pipeline_parallel=3), world)
    else:
        raise SystemExit(f"unknown case {case!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

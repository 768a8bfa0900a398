"""The names other trainers give hvdtrain's settings, so that a port's habits get the right name back.

A user arriving from Hugging Face's Trainer, Lightning or Accelerate types the setting they know
(``--learning_rate``, ``--max_epochs``, ``--bf16``). Spelling suggestions cannot find these: the
closest hvdtrain key to ``num_train_epochs`` by letters is ``num_workers``. This table answers them by
meaning instead, and says whose name it was.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

HF = "Hugging Face's Trainer"
LIGHTNING = "Lightning"
ACCELERATE = "Accelerate"

# name as the other trainer spells it -> (hvdtrain's setting, with its value where the name was a flag;
# whose name it is). Only names whose meaning is the same: a near meaning is left to the reference.
OTHER_NAMES: Dict[str, Tuple[str, str]] = {
    "learning_rate": ("--train.lr", HF),
    "num_train_epochs": ("--train.epochs", HF),
    "max_epochs": ("--train.epochs", LIGHTNING),
    "per_device_train_batch_size": ("--train.batch_size (per worker, as hvdtrain's)", HF),
    "per_device_eval_batch_size": ("--train.eval_batch_size", HF),
    "gradient_accumulation_steps": ("--train.accumulation", f"{HF} and {ACCELERATE}"),
    "accumulate_grad_batches": ("--train.accumulation", LIGHTNING),
    "gradient_clip_val": ("--train.max_grad_norm", LIGHTNING),
    "lr_scheduler_type": ("--train.lr_schedule", HF),
    "logging_steps": ("--train.log_every", HF),
    "log_every_n_steps": ("--train.log_every", LIGHTNING),
    "eval_steps": ("--train.eval_every", HF),
    "val_check_interval": ("--train.eval_every (steps)", LIGHTNING),
    "save_steps": ("--train.checkpoint_every", HF),
    "save_total_limit": ("--train.keep_checkpoints", HF),
    "output_dir": ("--train.checkpoint_dir (checkpoints) and --train.run_dir (logs)", HF),
    "default_root_dir": ("--train.checkpoint_dir (checkpoints) and --train.run_dir (logs)", LIGHTNING),
    "resume_from_checkpoint": ("--train.resume (true: the newest checkpoint in --train.checkpoint_dir)", HF),
    "dataloader_num_workers": ("--train.num_workers", HF),
    "gradient_checkpointing": ("--train.activation_checkpointing=full", HF),
    "torch_compile": ("--train.compile", HF),
    "bf16": ("--train.precision=bf16", HF),
    "fp16": ("--train.precision=fp16", HF),
    "mixed_precision": ("--train.precision (fp32, bf16 or fp16)", ACCELERATE),
    "max_train_steps": ("--train.max_steps", ACCELERATE),
    "num_warmup_steps": ("--train.warmup_steps", ACCELERATE),
    "lr_warmup_steps": ("--train.warmup_steps", ACCELERATE),
}

# Names that choose workers or devices: in hvdtrain the launcher does (horovodrun -np N, srun).
LAUNCHER_NAMES = {"devices": LIGHTNING, "num_nodes": LIGHTNING, "num_processes": ACCELERATE,
                  "nproc_per_node": "torchrun", "nnodes": "torchrun", "world_size": "torchrun"}


def other_name_hint(name: str) -> Optional[str]:
    """What hvdtrain calls ``name`` (a key with or without its section), or None when no other trainer
    uses it."""
    key = name.rpartition(".")[2]
    if key in OTHER_NAMES:
        setting, owner = OTHER_NAMES[key]
        return f"hvdtrain's name for it is {setting} ({key} is {owner}'s name)"
    if key in LAUNCHER_NAMES:
        return (f"{key} is {LAUNCHER_NAMES[key]}'s; in hvdtrain the launcher sets the workers "
                f"(horovodrun -np N, mpirun -np N, srun), and the script reads them")
    return None

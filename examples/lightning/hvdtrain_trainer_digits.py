"""lightning_digits.py (a LightningModule and the Trainer, the shape of Lightning's
examples/pytorch/basics/backbone_image_classifier.py) ported to hvdtrain's Trainer: training_step and
validation_step become one step function, configure_optimizers the optimizer built before the
Trainer, the Trainer's arguments TrainConfig's fields, at the rate the original trains at
(scale_lr=False: Lightning does not scale it). `diff lightning_digits.py hvdtrain_trainer_digits.py`.

    horovodrun -np 2 python examples/lightning/hvdtrain_trainer_digits.py
"""
import argparse

import torch
import torch.nn.functional as F

import hvdtrain
from hvdtrain.examples.digits import DigitsCNN, load_digits_datasets


def step(model, batch):
    x, y = batch
    y_hat = model(x)
    loss = F.cross_entropy(y_hat, y)
    return loss, {"acc": (y_hat.argmax(dim=1) == y).float().mean()}


def main(args):
    torch.manual_seed(args.seed)
    model = DigitsCNN(channels=16, hidden=64)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    config = hvdtrain.TrainConfig(
        epochs=args.epochs,
        batch_size=args.batch_size,
        seed=args.seed,
        scale_lr=False,
        strategy=args.strategy,
        precision=args.precision,
        accumulation=args.accumulate_grad_batches,
        max_grad_norm=1.0,
        checkpoint_dir=args.checkpoint_dir,
    )
    train_set, val_set = load_digits_datasets()
    trainer = hvdtrain.Trainer(model, optimizer, train_set, val_set, config, step_fn=step)
    try:
        history = trainer.fit()
    finally:
        trainer.close()
    if trainer.world.is_root:
        print(f"validation accuracy {100 * history[-1]['val_acc']:.2f}%")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Lightning digits example")
    parser.add_argument("--strategy", default="ddp", help="ddp, zero1, zero2, fsdp (default: ddp)")
    parser.add_argument("--precision", default="fp32", help="fp32, bf16, fp16 (default: fp32)")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1, help="micro-batches per step (default: 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="input batch size for training (default: 16)")
    parser.add_argument("--epochs", type=int, default=5, help="number of epochs to train (default: 5)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints go; a run there resumes from the last")
    main(parser.parse_args())

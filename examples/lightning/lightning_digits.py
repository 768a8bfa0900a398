"""Lightning, a LightningModule and the Trainer, the shape of Lightning's
examples/pytorch/basics/backbone_image_classifier.py, on the digits every install ships.
trainer_digits.py is the same job ported to hvdtrain's Trainer: `diff lightning_digits.py trainer_digits.py`.

    pip install lightning    # beside torch; hvdtrain itself only for its digits (PYTHONPATH=. will do)
    python examples/lightning/lightning_digits.py --accelerator cpu --devices 2 --strategy ddp
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from lightning.pytorch import LightningDataModule, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from hvdtrain.examples.digits import DigitsCNN, load_digits_datasets


class LitClassifier(LightningModule):
    def __init__(self, learning_rate: float = 0.05, momentum: float = 0.9):
        super().__init__()
        self.save_hyperparameters()
        self.backbone = DigitsCNN(channels=16, hidden=64)

    def forward(self, x):
        # use forward for inference/predictions
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        self.log("val_loss", F.cross_entropy(y_hat, y), sync_dist=True)
        self.log("val_acc", (y_hat.argmax(dim=1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        # self.hparams available because we called self.save_hyperparameters()
        return torch.optim.SGD(self.parameters(), lr=self.hparams.learning_rate, momentum=self.hparams.momentum)


class DigitsDataModule(LightningDataModule):
    def __init__(self, batch_size: int = 16):
        super().__init__()
        self.digits_train, self.digits_val = load_digits_datasets()
        self.batch_size = batch_size

    def train_dataloader(self):
        return DataLoader(self.digits_train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.digits_val, batch_size=self.batch_size)


def main(args):
    seed_everything(args.seed)
    model = LitClassifier(learning_rate=args.lr)
    trainer = Trainer(
        max_epochs=args.epochs,
        accelerator=args.accelerator,
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=args.strategy,
        precision=args.precision,
        accumulate_grad_batches=args.accumulate_grad_batches,
        gradient_clip_val=1.0,
        callbacks=[ModelCheckpoint(dirpath=args.checkpoint_dir, save_last=True)],
        enable_progress_bar=False,
    )
    trainer.fit(model, datamodule=DigitsDataModule(args.batch_size), ckpt_path="last")
    if trainer.is_global_zero:
        print(f"validation accuracy {100 * trainer.callback_metrics['val_acc']:.2f}%")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Lightning digits example")
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, ... (default: auto)")
    parser.add_argument("--devices", type=int, default=1, help="processes per node (default: 1)")
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (default: 1)")
    parser.add_argument("--strategy", default="auto", help="ddp, fsdp, ... (default: auto)")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed (default: 32-true)")
    parser.add_argument("--accumulate-grad-batches", type=int, default=1, help="micro-batches per step (default: 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="input batch size for training (default: 16)")
    parser.add_argument("--epochs", type=int, default=5, help="number of epochs to train (default: 5)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints go; a run there resumes from the last")
    main(parser.parse_args())

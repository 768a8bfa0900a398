"""horovod_digits.py ported to hvdtrain's Trainer instead of the library API: the loop and the test
set's evaluation are the Trainer's (the test set as its validation set: val_loss and val_accuracy
each epoch); the model, the optimizer, the data and the settings are the script's. It trains bitwise
the weights hvdtrain_digits.py trains, the same job in your own loop (tests/launch/test_own_loop.py).

    horovodrun -np 2 python examples/own_loop/trainer_digits.py --checkpoint-dir /tmp/digits-ckpt
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import hvdtrain

from hvdtrain.examples.digits import load_digits_datasets

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size for training")
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints go")
parser.add_argument("--save", default=None, help="where the trained model's state_dict goes")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


if __name__ == "__main__":
    args = parser.parse_args()
    torch.manual_seed(args.seed)  # every rank builds the same model (the Trainer broadcasts rank 0's anyway)
    torch.set_num_threads(1)

    train_dataset, test_dataset = load_digits_datasets()
    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    trainer = hvdtrain.Trainer(model, optimizer, train_dataset, test_dataset, hvdtrain.TrainConfig(
        batch_size=args.batch_size, epochs=args.epochs, seed=args.seed, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=20), loss_fn=F.nll_loss)
    history = trainer.fit()  # one record per epoch trained, the same on every rank
    for record in history:
        if trainer.world.is_root:
            print(f"epoch {record['epoch']:g}: test set: average loss {record['val_loss']:.4f}, "
                  f"accuracy {100.0 * record['val_accuracy']:.1f}%")
    if args.save and trainer.world.is_root:
        torch.save(model.state_dict(), args.save)

"""horovod_digits.py (the shape of Horovod's pytorch_mnist.py) ported to hvdtrain's library API:
the same loop, now sharded by hvdtrain (any train.strategy), resumable from its checkpoints after a
failure or a preemption, its rate scaled to the global batch. `diff horovod_digits.py hvdtrain_digits.py`
shows the port.

    horovodrun -np 2 python examples/own_loop/hvdtrain_digits.py --checkpoint-dir /tmp/digits-ckpt
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed
import horovod.torch as hvd
import hvdtrain

from hvdtrain.examples.digits import load_digits_datasets

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size for training")
parser.add_argument("--epochs", type=int, default=3, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.05, help="learning rate")
parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum")
parser.add_argument("--seed", type=int, default=42, help="random seed")
parser.add_argument("--log-interval", type=int, default=10, help="batches between logs")
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


def train(epoch):
    model.train()
    for batch_idx, (data, target) in enumerate(hv.batches()):
        output = model(data)
        loss = F.nll_loss(output, target)
        hv.backward(loss)
        hv.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            print(f"epoch {epoch} batch {batch_idx} loss {loss.item():.4f}")


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def test():
    model.eval()
    test_loss, test_accuracy = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            test_accuracy += output.argmax(dim=1).eq(target).float().sum().item()
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"test set: average loss {test_loss:.4f}, accuracy {100.0 * test_accuracy:.1f}%")


if __name__ == "__main__":
    args = parser.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset, test_dataset = load_digits_datasets()
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=False)
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.batch_size, sampler=test_sampler)

    model = Net()
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    hv = hvdtrain.setup(model, optimizer, train_dataset, hvdtrain.TrainConfig(batch_size=args.batch_size,
        epochs=args.epochs, seed=args.seed, checkpoint_dir=args.checkpoint_dir, checkpoint_every=20))

    for epoch in hv.epochs():
        train(epoch)
        test()
    if args.save and hvd.rank() == 0:
        torch.save(model.state_dict(), args.save)

"""fabric_digits.py (the shape of Lightning's examples/fabric/image_classifier/train_fabric.py)
ported to hvdtrain's own loop: the same loop and evaluation, now launched by horovodrun, mpirun or
srun, sharded by hvdtrain (any train.strategy), at the rate the original trains at (scale_lr=False:
Lightning does not scale it). `diff fabric_digits.py hvdtrain_digits.py` shows the port.

    horovodrun -np 2 python examples/lightning/hvdtrain_digits.py
"""
import argparse

import torch
import torch.nn.functional as F
import torch.optim as optim

import hvdtrain
from hvdtrain.examples.digits import DigitsCNN, load_digits_datasets


def run(hparams):
    torch.manual_seed(hparams.seed)
    train_dataset, test_dataset = load_digits_datasets()

    model = DigitsCNN(channels=16, hidden=64)  # remove call to .to(device)
    optimizer = optim.SGD(model.parameters(), lr=hparams.lr, momentum=hparams.momentum)

    # the model is moved automatically to the right device.
    hv = hvdtrain.setup(model, optimizer, train_dataset, hvdtrain.TrainConfig(
        batch_size=hparams.batch_size, epochs=hparams.epochs, seed=hparams.seed, scale_lr=False))
    test_loader = hv.loader(test_dataset)

    # EPOCH LOOP
    for epoch in hv.epochs():
        # TRAINING LOOP
        model.train()
        for batch_idx, (data, target) in enumerate(hv.batches()):
            # NOTE: no need to call `.to(device)` on the data, target
            output = model(data)
            loss = F.cross_entropy(output, target)
            hv.backward(loss)  # instead of loss.backward()
            hv.clip_grad_norm_(hparams.max_norm)
            hv.step()
            if batch_idx % hparams.log_interval == 0:
                hv.print(f"Train Epoch: {epoch} [{batch_idx}/{hv.steps_per_epoch}]\tLoss: {loss.item():.6f}")

        # TESTING LOOP
        model.eval()
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                data, target = data.to(hv.device), target.to(hv.device)
                output = model(data)
                test_loss += F.cross_entropy(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).sum().item()

        # reduce is used to aggregate the values across processes
        test_loss = hv.reduce(torch.tensor(test_loss), op="sum") / len(test_dataset)
        correct = hv.reduce(torch.tensor(correct), op="sum")
        hv.print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100 * correct / len(test_dataset):.2f}%")

    if hparams.save_model:
        hv.export("digits_cnn")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Fabric digits example")
    parser.add_argument("--batch-size", type=int, default=16, help="input batch size for training (default: 16)")
    parser.add_argument("--epochs", type=int, default=5, help="number of epochs to train (default: 5)")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default: 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping norm (default: 1.0)")
    parser.add_argument("--seed", type=int, default=42, help="random seed (default: 42)")
    parser.add_argument("--log-interval", type=int, default=20, help="batches between training logs")
    parser.add_argument("--save-model", action="store_true", default=False, help="For Saving the current Model")
    hparams = parser.parse_args()

    run(hparams)

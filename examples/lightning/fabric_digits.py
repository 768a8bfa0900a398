"""Lightning Fabric, the shape of Lightning's examples/fabric/image_classifier/train_fabric.py, on the
digits every install ships. hvdtrain_digits.py is the same script ported to hvdtrain's own loop:
`diff fabric_digits.py hvdtrain_digits.py`.

    pip install lightning    # beside torch; hvdtrain itself only for its digits (PYTHONPATH=. will do)
    python examples/lightning/fabric_digits.py --accelerator cpu --devices 2 --strategy ddp
"""
import argparse

import torch
import torch.nn.functional as F
import torch.optim as optim
from torch.utils.data import DataLoader

from lightning.fabric import Fabric, seed_everything

from hvdtrain.examples.digits import DigitsCNN, load_digits_datasets


def run(hparams):
    # Create the Lightning Fabric object; launch() starts the other processes (devices x num_nodes in all).
    fabric = Fabric(accelerator=hparams.accelerator, devices=hparams.devices, num_nodes=hparams.num_nodes,
                    strategy=hparams.strategy, precision=hparams.precision)
    fabric.launch()

    seed_everything(hparams.seed)  # instead of torch.manual_seed(...)

    # Let rank 0 read the data first, then everyone will load it
    with fabric.rank_zero_first(local=False):
        train_dataset, test_dataset = load_digits_datasets()

    train_loader = DataLoader(train_dataset, batch_size=hparams.batch_size, shuffle=True)
    test_loader = DataLoader(test_dataset, batch_size=hparams.batch_size)

    # don't forget to call `setup_dataloaders` to prepare for dataloaders for distributed training.
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)

    model = DigitsCNN(channels=16, hidden=64)  # remove call to .to(device)
    optimizer = optim.SGD(model.parameters(), lr=hparams.lr, momentum=hparams.momentum)

    # don't forget to call `setup` to prepare for model / optimizer for distributed training.
    # the model is moved automatically to the right device.
    model, optimizer = fabric.setup(model, optimizer)

    # EPOCH LOOP
    for epoch in range(1, hparams.epochs + 1):
        # TRAINING LOOP
        model.train()
        for batch_idx, (data, target) in enumerate(train_loader):
            # NOTE: no need to call `.to(device)` on the data, target
            optimizer.zero_grad()
            output = model(data)
            loss = F.cross_entropy(output, target)
            fabric.backward(loss)  # instead of loss.backward()
            fabric.clip_gradients(model, optimizer, max_norm=hparams.max_norm)
            optimizer.step()
            if batch_idx % hparams.log_interval == 0:
                fabric.print(f"Train Epoch: {epoch} [{batch_idx}/{len(train_loader)}]\tLoss: {loss.item():.6f}")

        # TESTING LOOP
        model.eval()
        test_loss, correct = 0.0, 0
        with torch.no_grad():
            for data, target in test_loader:
                # NOTE: no need to call `.to(device)` on the data, target
                output = model(data)
                test_loss += F.cross_entropy(output, target, reduction="sum").item()
                correct += output.argmax(dim=1).eq(target).sum().item()

        # all_reduce is used to aggregate the values across processes
        test_loss = fabric.all_reduce(test_loss, reduce_op="sum") / len(test_dataset)
        correct = fabric.all_reduce(correct, reduce_op="sum")
        fabric.print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100 * correct / len(test_dataset):.2f}%")

    # When using distributed training, use `fabric.save`
    # to ensure the current process is allowed to save a checkpoint
    if hparams.save_model:
        fabric.save("digits_cnn.pt", {"model": model})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Fabric digits example")
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, ... (default: auto)")
    parser.add_argument("--devices", type=int, default=1, help="processes per node (default: 1)")
    parser.add_argument("--num-nodes", type=int, default=1, help="machines (default: 1)")
    parser.add_argument("--strategy", default="auto", help="ddp, fsdp, ... (default: auto)")
    parser.add_argument("--precision", default="32-true", help="32-true, bf16-mixed, 16-mixed (default: 32-true)")
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

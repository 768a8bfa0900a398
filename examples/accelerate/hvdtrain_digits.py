"""accelerate_digits.py (the shape of Accelerate's examples/cv_example.py) ported to hvdtrain's own
loop: the same loop and evaluation, now launched by horovodrun, mpirun or srun, sharded by hvdtrain
(any train.strategy), at the rate the original trains at (scale_lr=False: Accelerate does not scale
it). `diff accelerate_digits.py hvdtrain_digits.py` shows the port.

    horovodrun -np 2 python examples/accelerate/hvdtrain_digits.py
"""
import argparse

import torch
import torch.nn.functional as F

import hvdtrain
from hvdtrain.examples.digits import DigitsCNN, load_digits_datasets


def training_function(config, args):
    # Sample hyper-parameters for learning rate, batch size, seed and a few other HPs
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    # Set the seed before building the model, so that every process starts from the same weights.
    torch.manual_seed(seed)
    train_dataset, eval_dataset = load_digits_datasets()

    model = DigitsCNN(channels=16, hidden=64)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)

    # Prepare everything
    hv = hvdtrain.setup(model, optimizer, train_dataset, hvdtrain.TrainConfig(
        batch_size=batch_size, epochs=num_epochs, seed=seed, scale_lr=False, precision=args.mixed_precision,
        accumulation=args.gradient_accumulation_steps))
    eval_dataloader = hv.loader(eval_dataset)

    # Now we train the model
    for epoch in hv.epochs():
        model.train()
        for step, (inputs, targets) in enumerate(hv.batches()):
            with hv.autocast():
                loss = F.cross_entropy(model(inputs), targets)
            hv.backward(loss)
            hv.clip_grad_norm_(config["max_grad_norm"])
            hv.step()

        model.eval()
        accurate = 0
        num_elems = 0
        for inputs, targets in eval_dataloader:
            inputs, targets = inputs.to(hv.device), targets.to(hv.device)
            with torch.no_grad():
                outputs = model(inputs)
            predictions = outputs.argmax(dim=-1)
            predictions, references = hv.gather((predictions, targets))
            accurate_preds = predictions == references
            num_elems += accurate_preds.shape[0]
            accurate += accurate_preds.long().sum()

        eval_metric = accurate.item() / num_elems
        hv.print(f"epoch {epoch}: accuracy {100 * eval_metric:.2f}%")


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default="fp32", choices=["fp32", "fp16", "bf16"],
                        help="Whether to use mixed precision.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="The number of minibatches to be ran before gradients are accumulated.")
    parser.add_argument("--num_epochs", type=int, default=5, help="Number of epochs to train.")
    parser.add_argument("--seed", type=int, default=42, help="Random seed.")
    args = parser.parse_args()
    config = {"lr": 3e-3, "num_epochs": args.num_epochs, "seed": args.seed, "batch_size": 16, "max_grad_norm": 1.0}
    training_function(config, args)


if __name__ == "__main__":
    main()

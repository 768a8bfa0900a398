"""Hugging Face Accelerate, the shape of its examples/cv_example.py (with by_feature/
gradient_accumulation.py's accumulate()), on the digits every install ships. hvdtrain_digits.py is
the same script ported to hvdtrain's own loop: `diff accelerate_digits.py hvdtrain_digits.py`.

    pip install accelerate    # beside torch; hvdtrain itself only for its digits (PYTHONPATH=. will do)
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate/accelerate_digits.py --cpu

(On CPUs `--multi_gpu` is what starts 2 processes: `accelerate launch --cpu --num_processes 2`
without a multi-CPU `accelerate config` runs one.)
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

from accelerate import Accelerator
from accelerate.utils import set_seed

from hvdtrain.examples.digits import DigitsCNN, load_digits_datasets


def training_function(config, args):
    # Initialize accelerator
    accelerator = Accelerator(cpu=args.cpu, mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)

    # Sample hyper-parameters for learning rate, batch size, seed and a few other HPs
    lr = config["lr"]
    num_epochs = int(config["num_epochs"])
    seed = int(config["seed"])
    batch_size = int(config["batch_size"])

    # Set the seed before building the model, so that every process starts from the same weights.
    set_seed(seed)
    with accelerator.main_process_first():
        train_dataset, eval_dataset = load_digits_datasets()

    # Instantiate dataloaders.
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=batch_size)
    eval_dataloader = DataLoader(eval_dataset, shuffle=False, batch_size=batch_size)

    model = DigitsCNN(channels=16, hidden=64)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)

    # Prepare everything
    model, optimizer, train_dataloader, eval_dataloader = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader
    )

    # Now we train the model
    for epoch in range(num_epochs):
        model.train()
        for step, (inputs, targets) in enumerate(train_dataloader):
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), config["max_grad_norm"])
                optimizer.step()
                optimizer.zero_grad()

        model.eval()
        accurate = 0
        num_elems = 0
        for inputs, targets in eval_dataloader:
            with torch.no_grad():
                outputs = model(inputs)
            predictions = outputs.argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, targets))
            accurate_preds = predictions == references
            num_elems += accurate_preds.shape[0]
            accurate += accurate_preds.long().sum()

        eval_metric = accurate.item() / num_elems
        # Use accelerator.print to print only on the main process.
        accelerator.print(f"epoch {epoch}: accuracy {100 * eval_metric:.2f}%")
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", type=str, default="no", choices=["no", "fp16", "bf16"],
                        help="Whether to use mixed precision.")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1,
                        help="The number of minibatches to be ran before gradients are accumulated.")
    parser.add_argument("--num_epochs", type=int, default=5, help="Number of epochs to train.")
    parser.add_argument("--seed", type=int, default=42, help="Random seed.")
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    args = parser.parse_args()
    config = {"lr": 3e-3, "num_epochs": args.num_epochs, "seed": args.seed, "batch_size": 16, "max_grad_norm": 1.0}
    training_function(config, args)


if __name__ == "__main__":
    main()

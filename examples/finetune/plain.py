"""A Hugging Face fine-tune with its own loop, on one process: dynamic padding, a cosine schedule with
warm-up, clipping, its own evaluation, torch.save. own_loop.py and trainer.py are its two ports to
hvdtrain; `diff plain.py own_loop.py` shows the first.

    python examples/finetune/plain.py --save /tmp/topics.pt
"""
import argparse

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding, get_cosine_schedule_with_warmup

from hvdtrain.examples.topics import small_classifier, topic_datasets

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--save", default="topics.pt")


def evaluate(model, val_set, collator):
    model.eval()
    correct = 0
    with torch.no_grad():
        for batch in DataLoader(val_set, batch_size=64, collate_fn=collator):
            correct += (model(**batch).logits.argmax(-1) == batch["labels"]).sum().item()
    model.train()
    return correct / len(val_set)


if __name__ == "__main__":
    args = parser.parse_args()
    tokenizer, train_set, val_set = topic_datasets()
    collator = DataCollatorWithPadding(tokenizer)
    model = small_classifier(len(tokenizer))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    loader = DataLoader(train_set, batch_size=16, shuffle=True, collate_fn=collator)
    total = args.epochs * len(loader)
    scheduler = get_cosine_schedule_with_warmup(optimizer, total // 10, total)
    for epoch in range(args.epochs):
        for batch in loader:
            loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        print(f"epoch {epoch}: validation accuracy {evaluate(model, val_set, collator):.3f}", flush=True)
    torch.save(model.state_dict(), args.save)

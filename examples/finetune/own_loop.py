"""plain.py ported to hvdtrain's library API: the same loop, scheduler, padding and evaluation, on any
number of workers (add strategy= and checkpoint_dir= to the TrainConfig to shard it and resume it).

    horovodrun -np 2 python examples/finetune/own_loop.py --save /tmp/topics.pt
"""
import argparse

import torch
import hvdtrain
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
    hv = hvdtrain.setup(model, optimizer, train_set, hvdtrain.TrainConfig(
        epochs=args.epochs, batch_size=16, scale_lr=False, max_grad_norm=1.0), collate_fn=collator)
    total = hv.total_steps
    scheduler = get_cosine_schedule_with_warmup(hv.optimizer, total // 10, total)
    hv.keep(scheduler=scheduler)
    for epoch in hv.epochs():
        for batch in hv.batches():
            loss = model(**batch).loss
            hv.backward(loss)
            hv.step()
            scheduler.step()
        accuracy = evaluate(model, val_set, collator)
        if hv.world.is_root:
            print(f"epoch {epoch}: validation accuracy {accuracy:.3f}", flush=True)
    if hv.world.is_root:
        torch.save(model.state_dict(), args.save)

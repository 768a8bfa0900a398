"""plain.py ported to hvdtrain's Trainer: the loop is the Trainer's; the padding (collate_fn), the
cosine schedule (lr_scheduler) and the evaluation (a callback) are the script's own.

    horovodrun -np 2 python examples/finetune/trainer.py --save /tmp/topics.pt
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
    class Evaluation(hvdtrain.Callback):
        def on_epoch_end(self, trainer, record):
            accuracy = evaluate(model, val_set, collator)
            if trainer.world.is_root:
                print(f"epoch {record['epoch']}: validation accuracy {accuracy:.3f}", flush=True)

    trainer = hvdtrain.Trainer(model, optimizer, train_set, None, hvdtrain.TrainConfig(
        epochs=args.epochs, batch_size=16, scale_lr=False, max_grad_norm=1.0), collate_fn=collator,
        step_fn=lambda model, batch: (model(**batch).loss, {}), callbacks=[Evaluation()],
        lr_scheduler=lambda optimizer, total: get_cosine_schedule_with_warmup(optimizer, total // 10, total))
    trainer.fit()
    if trainer.world.is_root:
        torch.save(model.state_dict(), args.save)

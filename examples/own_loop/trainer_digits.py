"""horovod_digits.py's job through hvdtrain's Trainer instead of your own loop: its model and
arguments (imported from it), with the optimizer, data and TrainConfig of its port hvdtrain_digits.py;
the loop and the test set's evaluation are the Trainer's (the test set as its validation set:
val_loss, val_accuracy each epoch; --log-interval is unused, the Trainer logs every log_every
steps). It trains bitwise the weights the port trains (tests/launch/test_own_loop.py).

    horovodrun -np 2 python examples/own_loop/trainer_digits.py --checkpoint-dir /tmp/digits-ckpt
"""
import torch
import torch.nn.functional as F
import torch.optim as optim
import hvdtrain

from hvdtrain.examples.digits import load_digits_datasets
from horovod_digits import Net, parser  # the Horovod script's model and arguments: the same job

parser.add_argument("--checkpoint-dir", default=None, help="where checkpoints go")


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

"""The benches' workloads: the example transformer language model among them, and what the
strategies bench gives each job."""
import argparse

import torch

from hvdtrain.bench.common import workloads
from hvdtrain.bench.strategies import driver as strategies
from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss


def options(*argv):
    parser = argparse.ArgumentParser()
    strategies.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_lm_workload_is_the_example_transformer_on_next_token_windows():
    model = workloads.build_model("lm", 0)
    inputs, targets = workloads.synthetic_dataset("lm", 8, seed=3)[:]
    assert isinstance(model, TinyTransformerLM) and len(model.blocks) == 8
    assert workloads.parameter_count(model)[0] >= strategies.MIN_PARAMETERS  # a real run's size, as the mlp's
    assert inputs.shape == targets.shape == (8, workloads.LM_CONTEXT) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # the targets are the next tokens
    logits = model(inputs)
    assert torch.equal(workloads.get("lm").loss(logits, targets), lm_loss(logits, targets))


def test_the_other_workloads_keep_their_data():
    """The cnn's and mlp's samples as they were made before the workloads carried their data."""
    generator = torch.Generator().manual_seed(5)
    inputs, labels = torch.randn((4, 1024), generator=generator), torch.randint(0, 10, (4,), generator=generator)
    made = workloads.synthetic_dataset("mlp", 4, seed=5)[:]
    assert torch.equal(made[0], inputs) and torch.equal(made[1], labels)


def test_each_job_gets_the_models_batch_and_the_allocator_asked_for():
    lm = options("--model", "lm", "--cpu-allocator", "system", "--memory-workers", "2")
    strategies._settings(lm)
    speed, memory = strategies.plan(lm, [2])
    argv = list(speed[0].args)
    assert lm.batch == 2 and argv[argv.index("--batch") + 1] == "2"
    assert all(list(job.args)[list(job.args).index("--cpu-allocator") + 1] == "system" for job in speed + memory)
    quick, given = options("--quick"), options("--quick", "--batch", "5")
    strategies._settings(quick), strategies._settings(given)
    assert (quick.model, quick.batch, given.batch) == ("cnn", 16, 5)

"""Adam steps of a pipeline stage beside one process's whole model: the comparison the pipeline
tests share (tests/mpi/test_pipeline.py, test_pipeline_schedules.py)."""
from typing import Callable, Dict, List, Tuple

import torch
import horovod.torch as hvd

from hvdtrain.examples.textlm import lm_loss
from hvdtrain.parallel.mesh import Mesh
from hvdtrain.parallel.pipeline.schedule import PipelineStage, run_schedule, split_micro_batches


def pipeline_beside_one_process(stage: PipelineStage, model: torch.nn.Module, reference: torch.nn.Module, mesh: Mesh,
                             schedule: str, micro_batches: int, global_batch: Callable, rows: int, steps: int,
                             tag: str) -> Tuple[List[List[float]], Dict[int, str]]:
    """``steps`` Adam steps of ``stage`` (cut from ``model``) beside ``reference`` (the same model,
    whole) on the whole global batch of ``rows`` sequences per data group; per step [|loss
    difference|, largest gradient difference, largest parameter difference after the step] (this
    rank's parameters, matched to the whole model's by name), and the names by parameter id.

    Args:
        stage: this rank's stage of ``model``.
        model: the model the stage was cut from (its parameter names).
        reference: the same model, whole, in one process.
        mesh: the pipeline (and data) layout.
        schedule: the pipeline schedule run_schedule runs.
        micro_batches: M.
        global_batch: (step, rows) -> (inputs, targets), the same on every rank.
        rows: sequences per data group and step.
        steps: Adam steps.
        tag: names this test's collectives.
    """
    names = {id(p): n for n, p in model.named_parameters()}  # a tied matrix: its first name
    theirs = dict(reference.named_parameters())
    params = list(stage.parameters())
    optimizer = torch.optim.Adam(params, lr=0.01)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    data, groups = mesh.coordinates.data, mesh.shape.data
    result = []
    for step in range(steps):
        inputs, targets = global_batch(step, rows * groups)
        mine = slice(data * rows, (data + 1) * rows)  # each data group its own share
        optimizer.zero_grad()
        loss = run_schedule(schedule, stage, mesh, split_micro_batches((inputs[mine], targets[mine]), micro_batches),
                            lm_loss)
        if mesh.data.process_set is not None:
            # Distributed: gradients and loss averaged over the data groups, by hand (one allreduce).
            flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.reshape(1)])
            flat = hvd.allreduce(flat, op=hvd.Average, name=f"{tag}.{step}.grads", process_set=mesh.data.process_set)
            for p, part in zip(params, flat[:-1].split([p.numel() for p in params])):
                p.grad = part.view_as(p).clone()
            loss = flat[-1]

        reference_optimizer.zero_grad()
        reference_loss = lm_loss(reference(inputs), targets)
        reference_loss.backward()
        grad_difference = max(float((p.grad - theirs[names[id(p)]].grad).abs().max()) for p in params)
        optimizer.step()
        reference_optimizer.step()
        param_difference = max(float((p.detach() - theirs[names[id(p)]].detach()).abs().max()) for p in params)
        result.append([abs(float(loss) - float(reference_loss.detach())), grad_difference, param_difference])
    return result, names

"""One case on every rank of a launch: a family built tiny, trained K steps under a layout through
the public Trainer and by one process alone, both inside ``float64_throughout()``, and the verdict.

Every rank takes the same path: whatever happens on one (a refusal, a crash, a result), the ranks
exchange it in one collective before anything is decided, and all return the same Outcome. A rank
that raises while the others wait in a collective of the Trainer's cannot be rescued here: the
launch's time limit ends it (the driver records the case as an error: a hang).
"""
from __future__ import annotations

import os
import time
import traceback
from typing import Any, Dict, List, Optional

import torch

from hvdtrain.config.train import TrainConfig
from hvdtrain.distributed import collectives
from hvdtrain.distributed.world import World
from hvdtrain.trainer import Trainer
from hvdtrain.verify import reference
from hvdtrain.verify.exact import float64_throughout
from hvdtrain.verify.layouts import Layout
from hvdtrain.verify.outcome import TOLERANCE, Outcome, refusal_reason
from hvdtrain.verify.tiny import SEQUENCE, make_model

SEED = 7
_HVDTRAIN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_VERIFY = os.path.dirname(os.path.abspath(__file__))


def run_case(world: World, family: str, config: Any, layout: Layout, optimizer: str, steps: int) -> Outcome:
    """One family under one layout: trained on this world and compared with one process (a collective: every rank
    returns the same Outcome).

    Args:
        world: this rank's World.
        family: the Hugging Face family.
        config: its tiny configuration.
        layout: the layout to train under.
        optimizer: the optimizer's name.
        steps: optimizer steps.
    """
    started = time.perf_counter()
    tag = f"verify.{family}.{layout.name}.{optimizer}"
    local, trainer, trained = _train(world, config, layout, optimizer, steps)
    # Every rank's end, to every rank: the decision below is the same everywhere.
    ends = collectives.allgather_object(local["end"], name=f"{tag}.ends")
    if all(end == "trained" for end in ends):
        local = _judge(world, config, layout, optimizer, steps, trained)
    elif local["end"] == "trained":
        local = {"end": "trained", "verdict": {"result": "trained", "message": "trained on this rank"}}
    groups = layout.tensor * layout.pipeline * layout.sequence * layout.experts > 1 or layout.strategy == "hsdp"
    if trainer is not None and groups and all(e != "set-up" for e in ends):
        trainer.close_mesh()
    verdicts = collectives.allgather_object(local["verdict"], name=f"{tag}.verdicts")
    outcome = _agreed(verdicts)
    return Outcome(family=family, layout=layout.name, optimizer=optimizer,
                   seconds=round(time.perf_counter() - started, 2), **outcome)


def _train(world: World, config: Any, layout: Layout, optimizer: str, steps: int):
    """({"end": set-up | first step | trained | ..., "verdict": ...} for this rank, the trainer or
    None, what it trained: initial and final gathered state, each step's world-mean loss)."""
    data = reference.token_data(config.vocab_size, SEQUENCE)
    losses: List[torch.Tensor] = []
    trainer: Optional[Trainer] = None
    try:
        model = make_model(config, seed=0, device="meta" if layout.meta else None)
        settings = TrainConfig(epochs=1, batch_size=reference.BATCH, lr=reference.RATES[optimizer], scale_lr=False,
                               warmup_epochs=0, max_steps=steps, seed=SEED, log_every=10**6, progress="off",
                               tensorboard=False, stall_timeout=0, **layout.settings())
        with float64_throughout():
            trainer = Trainer(model, reference.make_optimizer(optimizer, model.parameters()), data, None, settings,
                              world=world, loss_fn=reference.logits_loss)
            initial = _cloned(trainer.strategy.state_dict()["model"])
            _record_losses(trainer, losses)
            trainer.fit()
            final = _cloned(trainer.strategy.state_dict()["model"])
            step_losses = collectives.allreduce_sum(torch.stack(losses), name="verify.losses") / world.size
    except Exception as error:  # the verdict is agreed with the other ranks before anything is decided
        # The first step's audit refuses after its backward and before its update: still a refusal.
        updated = trainer is not None and trainer.global_step > 0
        end = "set-up" if trainer is None else "training" if updated else "first step"
        return {"end": end, "verdict": _failure(error, before_first_step=not updated)}, trainer, None
    return {"end": "trained", "verdict": None}, trainer, (initial, final, step_losses.tolist())


def _judge(world: World, config: Any, layout: Layout, optimizer: str, steps: int, trained) -> Dict:
    """One process's training, here on this rank alone, against what the layout trained."""
    initial, final, step_losses = trained
    data = reference.token_data(config.vocab_size, SEQUENCE)
    global_batch = reference.BATCH * layout.data
    try:
        with float64_throughout():
            expected, expected_losses = reference.one_process(make_model(config, seed=0), initial, data, SEED,
                                                              global_batch, steps, optimizer)
        found = reference.compare(final, expected, initial, step_losses, expected_losses, TOLERANCE)
    except Exception as error:
        return {"end": "judged", "verdict": {"result": "error", "message": f"one process's run failed: {_line(error)}"}}
    numbers = {"max_diff": found.max_diff, "loss_diff": found.loss_diff, "moved": found.moved}
    if found.equal(TOLERANCE):
        return {"end": "judged", "verdict": {"result": "equal", **numbers}}
    return {"end": "judged", "verdict": {"result": "differs", **numbers, "parameter": found.parameter,
                                         "parameter_diff": found.parameter_diff,
                                         "parameter_size": found.parameter_size}}


def _failure(error: BaseException, before_first_step: bool) -> Dict[str, Any]:
    """A refusal is hvdtrain's own clear error before the first update; anything else is an error."""
    message = _line(error)
    raised_by_hvdtrain = _raised_in_hvdtrain(error)
    if before_first_step and raised_by_hvdtrain and isinstance(error, (ValueError, TypeError, NotImplementedError)):
        return {"result": "refused", "message": message, "reason": refusal_reason(message)}
    where = "" if before_first_step else " (after the first step)"
    return {"result": "error", "message": f"{type(error).__name__}{where}: {message}"}


def _raised_in_hvdtrain(error: BaseException) -> bool:
    frames = traceback.extract_tb(error.__traceback__)
    last = os.path.abspath(frames[-1].filename) if frames else ""
    return last.startswith(_HVDTRAIN + os.sep) and not last.startswith(_VERIFY + os.sep)


def _agreed(verdicts: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The ranks' common verdict; ranks that disagree are an error (a refusal must be every rank's)."""
    if all(v == verdicts[0] for v in verdicts):
        return verdicts[0]
    kinds = sorted({v["result"] for v in verdicts})
    first = next(v for v in verdicts if v["result"] not in ("equal", "trained"))
    if kinds == ["refused"]:  # the same refusal in other words on some rank: still every rank's refusal
        return first
    return {"result": "error", "message": f"the ranks disagree ({', '.join(kinds)}); rank "
                                          f"{verdicts.index(first)}: {first.get('message') or first['result']}"}


def _record_losses(trainer: Trainer, losses: List[torch.Tensor]) -> None:
    """Each optimizer step's loss (this rank's) appended to ``losses`` as the Trainer runs."""
    forward_backward = trainer.strategy.forward_backward

    def recording(*args, **kwargs):
        loss, metrics = forward_backward(*args, **kwargs)
        losses.append(loss.detach().double().reshape(()))
        return loss, metrics

    trainer.strategy.forward_backward = recording


def _cloned(state) -> Dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in state.items()}


def _line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:400]

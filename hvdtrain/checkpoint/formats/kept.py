"""Your own state in hvdtrain's checkpoints (``Session.keep``): a scheduler you step yourself, your
counters. Encoded once into one string, so that the same field serves both formats: a full
checkpoint (torch.save) and a sharded one's manifest (JSON)."""
from __future__ import annotations

import base64
import io
from typing import Any, Dict, Mapping

import torch


def encode(objects: Mapping[str, Any]) -> str:
    """The objects' states (state_dict(), or the dict itself), as torch.save bytes in base64; "" for none."""
    if not objects:
        return ""
    states = {name: dict(value) if isinstance(value, dict) else value.state_dict() for name, value in objects.items()}
    buffer = io.BytesIO()
    torch.save(states, buffer)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode(text: str) -> Dict[str, Any]:
    """What encode() wrote: tensors and plain values only (``weights_only``), never code."""
    if not text:
        return {}
    try:
        return torch.load(io.BytesIO(base64.b64decode(text)), map_location="cpu", weights_only=True)
    except Exception as error:  # a state holding objects weights_only refuses: say whose
        raise ValueError(f"the checkpoint's kept state cannot be read ({error}): keep() objects whose "
                         f"state_dict() holds tensors and plain values (numbers, strings, lists, dicts)") from error


def restore(target: Any, state: Any) -> None:
    """A dict is updated in place (the caller's own object keeps its identity); others load_state_dict."""
    if isinstance(target, dict):
        target.update(state)
    else:
        target.load_state_dict(state)

"""A mixture-of-experts language model of hvdtrain's own: the example transformer (hvdtrain.examples.textlm)
with every block's MLP replaced by a routed mixture of experts, for expert parallelism without
Hugging Face (``train.expert_parallel=E``).

Each MoE layer is a router (a linear layer to one logit per expert, softmax, the top-k experts per
token, their probabilities renormalized to sum to 1), Switch Transformer's load-balancing loss
(Fedus et al. 2021, eq. 4: experts x the sum over experts of the share of routed pairs it received
times its mean router probability), and fused experts: one module holding every expert's SwiGLU
weights as 3-D parameters, experts first, with ``num_experts`` and the ``experts(hidden_states,
top_k_index, top_k_weights)`` call of transformers 5's experts modules. That is the layout
hvdtrain.parallel.experts splits over E ranks; a model of your own whose experts look like this
gets expert parallelism the same way.
"""
from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from hvdtrain.examples.textlm import TinyTransformerLM, lm_loss


class FusedExperts(nn.Module):
    """``num_experts`` SwiGLU experts of width ``hidden`` over ``d_model``, as two 3-D parameters with the
    experts first (what expert parallelism deals out: rank e of E holds rows [e n/E, (e+1) n/E)).

    Args:
        num_experts: the experts.
        d_model: the model's width, each expert's input and output.
        hidden: each expert's inner width.
    """

    def __init__(self, num_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * hidden, d_model))
        self.down_proj = nn.Parameter(torch.empty(num_experts, d_model, hidden))

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        """(tokens, d_model) -> (tokens, d_model): each token's experts (``top_k_index``, indices into this
        module's experts) applied and summed with its ``top_k_weights``. An expert no token chose does
        not run (its weights get no gradient this step), as transformers' eager experts do."""
        output = torch.zeros_like(hidden_states)
        for expert in range(self.num_experts):
            token, slot = torch.where(top_k_index == expert)
            if token.numel() == 0:
                continue
            gate, up = F.linear(hidden_states[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            routed = F.linear(F.silu(gate) * up, self.down_proj[expert])
            output.index_add_(0, token, routed * top_k_weights[token, slot, None].to(routed.dtype))
        return output


class MoEFeedForward(nn.Module):
    """Router, top-k and the fused experts in place of a block's MLP; keeps its last forward's
    load-balancing loss as ``aux_loss``.

    Args:
        d_model: the model's width.
        num_experts: experts per layer.
        top_k: experts each token is routed to.
        hidden: each expert's inner width.
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, hidden: int) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k}: route each token to between 1 and the {num_experts} experts")
        self.top_k = top_k
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, d_model, hidden)
        self.aux_loss = torch.zeros(())

    def route(self, flat: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(top-k expert indices, their renormalized weights, every expert's probability) per token."""
        probabilities = self.router(flat).softmax(dim=-1)
        weights, index = probabilities.topk(self.top_k, dim=-1)
        return index, weights / weights.sum(dim=-1, keepdim=True), probabilities

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        index, weights, probabilities = self.route(flat)
        experts = probabilities.shape[-1]
        received = F.one_hot(index, experts).sum(dim=1).to(probabilities.dtype).mean(dim=0) / self.top_k
        self.aux_loss = experts * (received * probabilities.mean(dim=0)).sum()
        return self.experts(flat, index, weights).reshape(x.shape)


class TinyMoELM(TinyTransformerLM):
    """The example transformer with a mixture of experts in every block: ``(batch, T)`` ids to
    ``(batch, T, vocab)`` logits; ``aux_loss()`` is the blocks' load-balancing losses summed.

    Args:
        vocab_size: tokens in the vocabulary.
        seq_len: the longest sequence.
        d_model: the hidden width.
        layers: decoder blocks.
        heads: attention heads per block.
        num_experts: experts per block.
        top_k: experts per token.
        expert_hidden: each expert's inner width (default: 2 x d_model).
        dropout: dropout probability.
    """

    def __init__(self, vocab_size: int, seq_len: int = 64, d_model: int = 128, layers: int = 2, heads: int = 4,
                 num_experts: int = 4, top_k: int = 2, expert_hidden: int = 0, dropout: float = 0.0) -> None:
        super().__init__(vocab_size, seq_len, d_model, layers, heads, dropout)
        for block in self.blocks:
            block.mlp = MoEFeedForward(d_model, num_experts, top_k, expert_hidden or 2 * d_model)
        self.reset_parameters()

    def aux_loss(self) -> torch.Tensor:
        return balance_loss(self)


def balance_loss(model: nn.Module) -> torch.Tensor:
    """The load-balancing losses of ``model``'s MoE layers at their last forward, summed (found in the
    model as given to a step, wrapped by a strategy or not)."""
    return sum(module.aux_loss for module in model.modules() if isinstance(module, MoEFeedForward))


def moe_lm_step(model: nn.Module, batch: Tuple[torch.Tensor, torch.Tensor], aux_coef: float = 0.01):
    """The next-token loss plus ``aux_coef`` x the load-balancing loss (a Trainer's step_fn)."""
    inputs, targets = batch
    loss = lm_loss(model(inputs), targets)
    balance = balance_loss(model)
    return loss + aux_coef * balance, {"balance": balance.detach()}

"""The MoE router's auxiliary (load-balancing) loss, computed across pipeline stages.

The loss ``transformers`` adds with ``output_router_logits`` is built from sums over
the routed tokens of every layer, so each decoder layer adds its own to a small running
total that travels with the hidden states, and the head turns the totals into the loss;
a forward hook on the router, active only inside :func:`capture`, reads the logits
(docs/design.md#router-loss).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, cast

import torch
from torch import nn

_local = threading.local()
_HOOKED = "_roundpipe_records_router_logits"


@dataclass(frozen=True)
class RouterLoss:
    """How the model adds its router loss: ``coef × aux`` over ``num_experts`` with top-k."""

    num_experts: int
    top_k: int
    coef: float


class _MoECausalLM(Protocol):
    """The router settings a MoE ``*ForCausalLM`` keeps as plain attributes."""

    num_experts: int
    num_experts_per_tok: int
    router_aux_loss_coef: float


def router_loss_of(model: nn.Module) -> RouterLoss | None:
    """The router loss ``model`` (a MoE ``*ForCausalLM``) adds to its loss, if any."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    moe = cast(_MoECausalLM, model)
    return RouterLoss(
        int(moe.num_experts), int(moe.num_experts_per_tok), float(moe.router_aux_loss_coef)
    )


def router_class(inner: nn.Module) -> tuple[type[nn.Module], int] | None:
    """The router module class whose output ``index`` holds the router logits, as
    ``transformers`` records them (``_can_record_outputs["router_logits"]``)."""
    recorder = getattr(type(inner), "_can_record_outputs", {}).get("router_logits")
    if recorder is None:
        return None
    if isinstance(recorder, type):
        return recorder, 0
    return recorder.target_class, recorder.index


def hook_routers(layer: nn.Module, target: type[nn.Module], index: int) -> bool:
    """Record the router logits of ``layer``'s routers while :func:`capture` is active;
    whether ``layer`` has any (dense layers of a MoE model have none)."""

    def record(_module, _inputs, output) -> None:
        sink = getattr(_local, "sink", None)
        if sink is not None:
            sink.append(output[index] if isinstance(output, tuple | list) else output)

    routers = [m for m in layer.modules() if isinstance(m, target)]
    for router in routers:
        if not hasattr(router, _HOOKED):  # wrapping the model again must not count twice
            router.register_forward_hook(record)
            setattr(router, _HOOKED, True)
    return bool(routers)


@contextlib.contextmanager
def capture() -> Iterator[list[torch.Tensor]]:
    """The router logits computed by this thread inside the ``with`` block."""
    outer = getattr(_local, "sink", None)
    _local.sink = []
    try:
        yield _local.sink
    finally:
        _local.sink = outer


def add_router_sums(sums, logits: list[torch.Tensor], attention_mask, loss: RouterLoss):
    """``sums`` (``None`` or ``(chosen, probability, tokens)``) plus those of ``logits``,
    exactly as ``load_balancing_loss_func`` accumulates them."""
    for layer_logits in logits:
        weights = torch.softmax(layer_logits, dim=-1)
        _, selected = torch.topk(weights, loss.top_k, dim=-1)
        if attention_mask is None:
            chosen = torch.histc(
                selected.reshape(-1).float(), bins=loss.num_experts, min=0, max=loss.num_experts
            )
            probability = weights.float().sum(dim=0)
            tokens = torch.tensor(float(weights.shape[0]), device=weights.device)
        else:
            flat = attention_mask.reshape(-1).to(device=weights.device, dtype=torch.float32)
            chosen = torch.zeros(loss.num_experts, device=weights.device).scatter_add_(
                0, selected.reshape(-1), flat.repeat_interleave(loss.top_k)
            )
            probability = (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
            tokens = flat.sum()
        if sums is None:
            sums = (chosen, probability, tokens)
        else:
            sums = (sums[0] + chosen, sums[1] + probability, sums[2] + tokens)
    return sums


def aux_loss(sums, loss: RouterLoss) -> torch.Tensor:
    """The load-balancing loss of the totals ``sums`` (without the coefficient)."""
    chosen, probability, tokens = sums
    return torch.sum((chosen / tokens) * (probability / tokens).unsqueeze(0)) * loss.num_experts

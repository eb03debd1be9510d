"""Plain-PyTorch reference training, the oracle every RoundPipe test compares against."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn


def mse_sum(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).sum()


def mlp(seed: int = 0, width: int = 16, depth: int = 6, inputs: int = 8, outputs: int = 4):
    """``depth`` layers alternating Linear and Tanh, ending with a Linear."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(inputs, width)]
    for _ in range(depth - 2):
        layers += [nn.Tanh()] if isinstance(layers[-1], nn.Linear) else [nn.Linear(width, width)]
    layers.append(nn.Linear(width, outputs))
    return nn.Sequential(*layers)


def batch(seed: int = 1, size: int = 13, inputs: int = 8, outputs: int = 4):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, inputs, generator=generator), torch.randn(
        size, outputs, generator=generator
    )


def weighted_microbatches(x: torch.Tensor, y: torch.Tensor, num_microbatch: int, scale_grads=True):
    """``(x_i, y_i, w_i)`` for each microbatch: ``w_i`` the weight RoundPipe gives its
    loss, ``r_i / R`` for ``r_i`` of the ``R`` rows (``scale_grads``, the default) or 1."""
    rows = x.shape[0]
    pairs = zip(x.tensor_split(num_microbatch), y.tensor_split(num_microbatch), strict=True)
    return [(xm, ym, xm.shape[0] / rows if scale_grads else 1.0) for xm, ym in pairs]


def reference_loss_and_grads(
    model: nn.Module,
    x,
    y,
    num_microbatch: int,
    loss_fn: Callable = mse_sum,
    scale_grads: bool = True,
) -> torch.Tensor:
    """RoundPipe's loss: the microbatch losses' mean weighted by rows (their sum
    without ``scale_grads``); leaves its gradients in ``model``'s ``.grad``."""
    total = torch.zeros(())
    for xm, ym, weight in weighted_microbatches(x, y, num_microbatch, scale_grads):
        loss = loss_fn(model(xm), ym) * weight
        loss.backward()
        total = total + loss.detach()
    return total


def pytorch_sgd_step(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, num_microbatch: int, lr: float
) -> nn.Module:
    """A copy of ``model`` after one SGD step (``lr``) on RoundPipe's loss of ``(x, y)``
    (:func:`reference_loss_and_grads`), its gradients zeroed again."""
    model = copy.deepcopy(model)
    reference_loss_and_grads(model, x, y, num_microbatch)
    torch.optim.SGD(model.parameters(), lr=lr).step()
    model.zero_grad()
    return model


def pytorch_sgd_steps(
    model: nn.Module, steps: list[list[int]], num_microbatch: int, lr: float
) -> nn.Module:
    """A copy of ``model`` after one SGD step (``lr``) per entry of ``steps``, each over
    the summed gradients of the calls on the batches ``batch(seed)`` of its seeds."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for seeds in steps:
        for seed in seeds:
            x, y = batch(seed=seed)
            reference_loss_and_grads(model, x, y, num_microbatch)
        optimizer.step()
        optimizer.zero_grad()
    return model


def train_reference(
    model: nn.Module,
    batches: list,
    num_microbatch: int,
    make_optimizer: Callable,
    stale: bool = False,
    loss_fn: Callable = mse_sum,
    scale_grads: bool = True,
) -> tuple[nn.Module, list[float]]:
    """Train a copy of ``model``; with ``stale``, gradients use the weights one step older."""
    model = copy.deepcopy(model)
    optimizer = make_optimizer(model.parameters())
    losses = []
    previous = copy.deepcopy(model)
    for x, y in batches:
        grad_model = previous if stale else model
        grad_model.zero_grad()
        losses.append(
            reference_loss_and_grads(grad_model, x, y, num_microbatch, loss_fn, scale_grads).item()
        )
        snapshot = copy.deepcopy(model)
        for p, g in zip(model.parameters(), grad_model.parameters(), strict=True):
            p.grad = None if g.grad is None else g.grad.clone()
        optimizer.step()
        optimizer.zero_grad()
        previous = snapshot
    return model, losses


def assert_grads_close(wrapped: nn.Module, reference: nn.Module, atol: float = 1e-5) -> None:
    pairs = zip(wrapped.named_parameters(), reference.named_parameters(), strict=True)
    for (name, got), (_, want) in pairs:
        if want.grad is None:
            assert got.grad is None or not got.grad.any(), f"{name}: unexpected gradient"
            continue
        assert got.grad is not None, f"{name}: gradient missing"
        torch.testing.assert_close(got.grad, want.grad, atol=atol, rtol=1e-5, msg=name)


def assert_weights_close(wrapped: nn.Module, reference: nn.Module, atol: float = 1e-5) -> None:
    pairs = zip(wrapped.named_parameters(), reference.named_parameters(), strict=True)
    for (name, got), (_, want) in pairs:
        torch.testing.assert_close(got.detach(), want.detach(), atol=atol, rtol=1e-5, msg=name)

"""The oracle of the lean ``roundpipe train`` runs (``test_train_lean.py``): every
optimizer step a run takes, recorded as the optimizer saw it, and replayed in plain
PyTorch on the same gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch

import roundpipe.optim


@dataclass
class Step:
    """One optimizer step of a run, as the optimizer saw it."""

    before: list[torch.Tensor]
    grads: list[torch.Tensor | None]
    lrs: list[float]
    after: list[torch.Tensor]


@dataclass
class Recorded:
    names: list[str]  # the masters' names, in the optimizer's order
    groups: list[tuple[int, float]]  # (parameters, weight decay) of each group
    optimizer: torch.optim.Optimizer
    steps: list[Step]


def recording(monkeypatch) -> list[Recorded]:
    """Every optimizer the runs of this process build, with each of its steps."""
    import roundpipe.train.loop as loop

    built: list[Recorded] = []
    build = loop.build_optimization

    def recorded_build(pipe, *args, **kwargs):
        optimization = build(pipe, *args, **kwargs)
        optimizer = optimization.optimizer
        name_of = {id(p): n for n, p in pipe.optim_named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        groups = [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups]
        record = Recorded([name_of[id(p)] for p in params], groups, optimizer, [])
        real_step = optimizer.step

        def step(*a, **k):
            before = [p.detach().clone() for p in params]
            grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
            lrs = [float(g["lr"]) for g in optimizer.param_groups]
            result = real_step(*a, **k)
            record.steps.append(Step(before, grads, lrs, [p.detach().clone() for p in params]))
            return result

        optimizer.step = step
        built.append(record)
        return optimization

    monkeypatch.setattr(loop, "build_optimization", recorded_build)
    return built


def replay(record: Recorded, states: str, masters: str, seed: int) -> None:
    """Plain PyTorch: ``make_adamw`` over plain tensors (the run's first weights, in the
    run's groups) stepped on each of the run's gradients at each step's rates, equal
    to the run's masters after every step, bit for bit."""
    params = [p.clone() for p in record.steps[0].before]
    groups, start = [], 0
    for count, weight_decay in record.groups:
        groups.append({"params": params[start : start + count], "weight_decay": weight_decay})
        start += count
    oracle = roundpipe.optim.make_adamw(
        groups, lr=1.0, states=states, stochastic_round=masters == "bf16", seed=seed
    )
    assert type(oracle) is type(record.optimizer)
    for number, step in enumerate(record.steps, 1):
        for name, param, before in zip(record.names, params, step.before, strict=True):
            assert torch.equal(param, before), f"step {number}: {name} before the step"
        for param, grad in zip(params, step.grads, strict=True):
            param.grad = grad
        for group, lr in zip(oracle.param_groups, step.lrs, strict=True):
            group["lr"] = lr
        oracle.step()
        for name, param, after in zip(record.names, params, step.after, strict=True):
            assert param.dtype == after.dtype and torch.equal(param, after), (
                f"step {number}: {name} after the step"
            )

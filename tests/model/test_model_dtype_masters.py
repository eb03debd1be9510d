"""Masters in the model's dtype: ``RoundPipe(model_bf16, optim_dtype=torch.bfloat16)``.

The masters are then the model's own tensors (no second copy), synchronous steps write
the weights in place (no spare upload buffer), asynchronous steps write the other
buffer while calls read the previous version. Oracle: plain PyTorch running the same
optimizer on the same gradients (captured inside ``step_fn``), bit for bit, and the
losses of one-step-stale calls against plain PyTorch at the version they read.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.oracle import batch, mlp, mse_sum, weighted_microbatches
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

CONFIG = RoundPipeRunConfig(num_microbatch=3)


def bf16_pipe(model, **options) -> RoundPipe:
    return RoundPipe(
        model, devices="emulated:2", optim_dtype=torch.bfloat16, model_run_config=CONFIG, **options
    )


def capture_step(optimizer, applied: list):
    """A step_fn that records the gradients it applies, then steps."""

    def step() -> None:
        applied.append(
            [p.grad.clone() for group in optimizer.param_groups for p in group["params"]]
        )
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def replay(initial: nn.Module, applied: list, make_optimizer) -> list[torch.Tensor]:
    """Plain PyTorch: the same optimizer on tensors starting at ``initial``'s weights,
    fed the captured gradients step by step."""
    params = [p.detach().clone().requires_grad_(True) for p in initial.parameters()]
    optimizer = make_optimizer(params)
    for grads in applied:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return params


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def test_masters_are_the_model_weights_and_sync_steps_need_no_spare(no_hang):
    model = mlp().to(torch.bfloat16)
    user = list(model.parameters())
    with bf16_pipe(model) as pipe:
        masters = list(pipe.optim_parameters())
        assert all(m.dtype == torch.bfloat16 for m in masters)
        assert all(m is not p for m, p in zip(masters, user, strict=True))
        assert [m.data_ptr() for m in masters] == [p.data_ptr() for p in user]
        optimizer = adamw(pipe.optim_parameters())
        for seed in range(3):
            x, y = batch(seed=seed)
            no_hang(pipe.forward_backward, (x.bfloat16(),), label=y.bfloat16(), loss_fn=mse_sum)
            no_hang(pipe.step, lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        no_hang(pipe.synchronize)
        assert pipe.runtime.session.versions._spares == {}, "a synchronous step allocated a spare"
        assert [m.data_ptr() for m in pipe.optim_parameters()] == [p.data_ptr() for p in user]


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_steps_equal_plain_pytorch_on_the_same_gradients(is_async, no_hang):
    model = mlp().to(torch.bfloat16)
    initial = copy.deepcopy(model)
    applied: list = []
    with bf16_pipe(model) as pipe:
        optimizer = adamw(pipe.optim_parameters())
        for seed in range(5):
            x, y = batch(seed=seed)
            no_hang(pipe.forward_backward, (x.bfloat16(),), label=y.bfloat16(), loss_fn=mse_sum)
            no_hang(pipe.step, capture_step(optimizer, applied), is_async=is_async)
        no_hang(pipe.synchronize)
        got = [p.detach().clone() for p in model.parameters()]
        masters = [m.detach().clone() for m in pipe.optim_parameters()]
    want = replay(initial, applied, adamw)
    assert len(applied) == 5
    for g, m, w in zip(got, masters, want, strict=True):
        assert torch.equal(g, w.detach())
        assert torch.equal(m, w.detach())


def test_async_calls_read_the_previous_version(no_hang):
    """Call ``i`` computes its loss at the weights after step ``i - 1`` (one step stale),
    although the step writing the next version runs meanwhile."""
    model = mlp().to(torch.bfloat16)
    versions = [copy.deepcopy(model)]
    applied: list = []
    losses = []
    with bf16_pipe(model) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
        for seed in range(4):
            x, y = batch(seed=seed)
            losses.append(
                no_hang(pipe.forward_backward, (x.bfloat16(),), label=y.bfloat16(), loss_fn=mse_sum)
            )
            no_hang(pipe.step, capture_step(optimizer, applied), is_async=True)
        no_hang(pipe.synchronize)
    params = [p.detach().clone() for p in versions[0].parameters()]
    for grads in applied:  # the weights after each step, in plain PyTorch
        params = [p - 0.05 * g for p, g in zip(params, grads, strict=True)]
        version = copy.deepcopy(versions[0])
        with torch.no_grad():
            for p, value in zip(version.parameters(), params, strict=True):
                p.copy_(value)
        versions.append(version)
    for i, loss in enumerate(losses):
        x, y = batch(seed=i)
        stale = versions[max(i - 1, 0)]
        want = sum(
            mse_sum(stale(xs.bfloat16()), ys.bfloat16()).float() * weight
            for xs, ys, weight in weighted_microbatches(x, y, 3)
        )
        torch.testing.assert_close(loss.float(), want, rtol=2e-2, atol=1e-3)


def test_user_writes_between_steps_are_trained_from(no_hang):
    model = mlp().to(torch.bfloat16)
    with bf16_pipe(model) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
        x, y = batch()
        no_hang(pipe.forward_backward, (x.bfloat16(),), label=y.bfloat16(), loss_fn=mse_sum)
        no_hang(pipe.step, lambda: (optimizer.step(), optimizer.zero_grad()), is_async=True)
        no_hang(pipe.synchronize)
        with torch.no_grad():
            model[0].weight.fill_(0.25)
        first = next(pipe.optim_parameters())
        no_hang(pipe.forward_backward, (x.bfloat16(),), label=y.bfloat16(), loss_fn=mse_sum)
        assert torch.all(first.detach() == 0.25)
        no_hang(pipe.step, lambda: (optimizer.step(), optimizer.zero_grad()), is_async=True)
        no_hang(pipe.synchronize)
        assert first.data_ptr() == model[0].weight.data_ptr()
        assert not torch.all(model[0].weight == 0.25)


def test_checkpoint_round_trip_resumes_bit_for_bit(tmp_path, no_hang):
    def run(steps, save_at=None, load=None):
        model = mlp().to(torch.bfloat16)
        with bf16_pipe(model) as pipe:
            optimizer = adamw(pipe.optim_parameters())
            start = 0
            if load is not None:
                no_hang(pipe.load_checkpoint, load, optimizer=optimizer)
                start = save_at
            for seed in range(start, steps):
                x, y = batch(seed=seed)
                no_hang(pipe.forward_backward, (x.bfloat16(),), label=y.bfloat16(), loss_fn=mse_sum)
                no_hang(pipe.step, lambda: (optimizer.step(), optimizer.zero_grad()), is_async=True)
                if seed + 1 == save_at and load is None:
                    no_hang(pipe.save_checkpoint, tmp_path / "ckpt", optimizer=optimizer)
            no_hang(pipe.synchronize)
            return [p.detach().clone() for p in model.parameters()]

    straight = run(4, save_at=2)
    resumed = run(4, save_at=2, load=tmp_path / "ckpt")
    for a, b in zip(straight, resumed, strict=True):
        assert torch.equal(a, b)

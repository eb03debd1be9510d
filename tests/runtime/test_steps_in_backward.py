"""Steps in backward: post-accumulate-grad hooks on the masters, as in PyTorch.

PyTorch's per-parameter optimizers run by ``register_post_accumulate_grad_hook`` step
each parameter as soon as its gradient is in, so no full set of gradients is held.
Registered on ``pipe.optim_parameters()`` they run once per call, when every stage
using the master has added its gradient; the oracle is the same hooks on plain PyTorch.
"""

from __future__ import annotations

import pytest
import torch
from support.oracle import mse_sum, weighted_microbatches
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

WIDTH = 32
DEPTH = 6
ONE_LAYER_PER_STAGE = RoundPipeRunConfig(
    num_microbatch=2, execute_plan=f"{DEPTH - 1}|" + ",".join("1" * DEPTH)
)


def linears(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))).to(dtype)


def data(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(4, WIDTH, generator=generator)
    return x.to(dtype), torch.randn(4, WIDTH, generator=generator).to(dtype)


def step_in_backward(params, make=None, on_hook=None) -> dict:
    """PyTorch's recipe: one optimizer per parameter, stepped by its hook."""
    make = make or (lambda p: torch.optim.AdamW([p], lr=1e-2))
    optimizers = {p: make(p) for p in params}
    calls = {p: 0 for p in params}

    def hook(param: torch.Tensor) -> None:
        if on_hook is not None:
            on_hook(param)
        calls[param] += 1
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(hook)
    return calls


def pytorch_run(model: nn.Module, x, y, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        loss = sum(mse_sum(model(a), b) * w for a, b, w in weighted_microbatches(x, y, 2))
        loss.backward()
        losses.append(float(loss.detach()))
    return losses


def test_hooks_step_each_parameter_once_per_call_as_in_pytorch(no_hang):
    x, y = data()
    with RoundPipe(linears(), devices="emulated:2", model_run_config=ONE_LAYER_PER_STAGE) as pipe:
        calls = step_in_backward(list(pipe.optim_parameters()))
        losses = [
            float(no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)) for _ in range(3)
        ]
        no_hang(pipe.synchronize)
        trained = [p.detach().clone() for p in pipe.parameters()]
        grads = [p.grad for p in pipe.parameters()]

    reference = linears()
    ref_calls = step_in_backward(list(reference.parameters()))
    assert losses == pytest.approx(pytorch_run(reference, x, y, 3), rel=1e-6)
    assert sorted(calls.values()) == sorted(ref_calls.values()) == [3] * 2 * DEPTH
    for got, want in zip(trained, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)
    assert all(g is None for g in grads)  # the hooks zeroed them, as in PyTorch


def test_no_full_set_of_gradients_is_held(no_hang):
    x, y = data()
    held: list[int] = []
    with RoundPipe(linears(), devices="emulated:2", model_run_config=ONE_LAYER_PER_STAGE) as pipe:
        masters = list(pipe.optim_parameters())

        def count(_: torch.Tensor) -> None:
            held.append(sum(m.grad is not None for m in masters))

        step_in_backward(masters, on_hook=count)
        for _ in range(2):
            no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(pipe.synchronize)
    # Two devices, one layer (weight and bias) per backward stage: a hook sees its own
    # layer's gradients and at most the other device's; a step after the backward
    # would see all 12.
    assert len(held) == 2 * 2 * DEPTH
    assert max(held) <= 4, held


def test_tied_parameters_step_once_with_every_stage_s_gradient(no_hang):
    def tied() -> nn.Sequential:
        model = linears()
        model[DEPTH - 1].weight = model[0].weight  # used by the first and the last stage
        return model

    x, y = data()
    with RoundPipe(tied(), devices="emulated:2", model_run_config=ONE_LAYER_PER_STAGE) as pipe:
        calls = step_in_backward(list(pipe.optim_parameters()))
        for _ in range(2):
            no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(pipe.synchronize)
        trained = [p.detach().clone() for p in pipe.parameters()]

    reference = tied()
    step_in_backward(list(reference.parameters()))
    pytorch_run(reference, x, y, 2)
    assert sorted(calls.values()) == [2] * (2 * DEPTH - 1)
    for got, want in zip(trained, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-6, atol=1e-7)


def test_a_deferred_backward_steps_in_backward_too(no_hang):
    x, y = data()
    with RoundPipe(linears(), devices="emulated:2", model_run_config=ONE_LAYER_PER_STAGE) as pipe:
        step_in_backward(list(pipe.optim_parameters()))
        for _ in range(2):
            mse_sum(pipe(x), y).backward()
        no_hang(pipe.synchronize)
        trained = [p.detach().clone() for p in pipe.parameters()]

    reference = linears()
    step_in_backward(list(reference.parameters()))
    for _ in range(2):
        mse_sum(reference(x), y).backward()
    for got, want in zip(trained, reference.parameters(), strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def test_bf16_masters_with_8_bit_moments_step_as_after_the_backward(no_hang):
    """The lean setting: bf16 masters that are the weights, per-parameter 8-bit AdamW;
    bit for bit what the same optimizers do in a synchronous step after the backward."""
    pytest.importorskip("torchao")
    from roundpipe.optim import make_adamw

    x, y = data(torch.bfloat16)

    def make(p: torch.Tensor):
        return make_adamw([p], lr=1e-3, states="int8", stochastic_round=True, seed=3)

    def run(in_backward: bool) -> list[torch.Tensor]:
        model = linears(dtype=torch.bfloat16)
        with RoundPipe(
            model,
            devices="emulated:2",
            model_run_config=ONE_LAYER_PER_STAGE,
            optim_dtype=torch.bfloat16,
        ) as pipe:
            masters = list(pipe.optim_parameters())
            if in_backward:
                step_in_backward(masters, make)
            else:
                optimizers = [make(p) for p in masters]
            for _ in range(3):
                no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
                if not in_backward:
                    pipe.step(lambda: [(o.step(), o.zero_grad()) for o in optimizers], False)
            no_hang(pipe.synchronize)
            return [p.detach().clone() for p in pipe.parameters()]

    for got, want in zip(run(True), run(False), strict=True):
        assert torch.equal(got, want)


def test_what_steps_in_backward_cannot_do_is_refused(no_hang):
    x, y = data()
    with RoundPipe(linears(), devices="emulated:2", model_run_config=ONE_LAYER_PER_STAGE) as pipe:
        step_in_backward(list(pipe.optim_parameters()))
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        with pytest.raises(ValueError, match="is_async=False"):
            pipe.step(lambda: None)
        pipe.step(lambda: None, is_async=False)  # e.g. a scheduler's step
        first, second = pipe(x), pipe(x)
        mse_sum(second, y).backward()  # steps the weights the first would recompute with
        with pytest.raises(RuntimeError, match="weights changed"):
            mse_sum(first, y).backward()
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)  # usable again

    scaler = torch.amp.GradScaler("cpu")
    with RoundPipe(linears(), devices="emulated:2", grad_scaler=scaler) as pipe:
        step_in_backward(list(pipe.optim_parameters()))
        with pytest.raises(RuntimeError, match="GradScaler"):
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)


def test_a_failing_hook_fails_the_call_and_the_model_stays_usable(no_hang):
    x, y = data()
    with RoundPipe(linears(), devices="emulated:2", model_run_config=ONE_LAYER_PER_STAGE) as pipe:
        masters = list(pipe.optim_parameters())
        failing = {"on": True}

        def fail_once(param: torch.Tensor) -> None:
            if param is masters[0] and failing.pop("on", False):
                raise ValueError("hook failed")

        calls = step_in_backward(masters, on_hook=fail_once)
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        with pytest.raises(ValueError, match="hook failed") as failed:
            no_hang(pipe.synchronize)
        note = " ".join(getattr(failed.value, "__notes__", []))
        assert "parameters had stepped in the backward before it failed" in note
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(pipe.synchronize)
    # As in PyTorch, the parameters whose hooks ran before the failure stepped (which
    # ones depends on the order the devices' gradients came in); the second call stepped
    # every one.
    assert calls[masters[0]] == 1 and all(calls[m] in (1, 2) for m in masters[2:])

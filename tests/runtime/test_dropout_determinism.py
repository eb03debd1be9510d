"""Dropout trains as in PyTorch and reproducibly: layer ``i`` of microbatch ``m`` draws as
after ``torch.manual_seed(layer_seed(microbatch_seed(call_seed, m), i))``, on whatever
device and thread runs it, so runs (and resumes) are bit-identical and the gradients
are those of the masks the forward drew; ``train()``/``eval()`` as on an ``nn.Module``.

The oracle runs the model layer by layer in plain PyTorch (fp64), seeding each layer
so (docs/design.md#random-numbers).
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from support.oracle import batch, mse_sum, weighted_microbatches
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig
from roundpipe.devices.emulated import random as emulated_random
from roundpipe.runtime.seeds import CallSeeds, layer_seed, microbatch_seed

SEED = 1234


def dropout_model(p: float = 0.5) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(8, 16), nn.Dropout(p), nn.Linear(16, 16), nn.Tanh(), nn.Dropout(p),
        nn.Linear(16, 16), nn.Linear(16, 4),
    ).double()  # fmt: skip


def data():
    x, y = batch()
    return x.double(), y.double()


def wrap(model: nn.Module, devices: int = 3, plan: str = "2,2|3,1,1,1,1", **config) -> RoundPipe:
    """``model`` on emulated devices, wrapped just after ``torch.manual_seed(SEED)``."""
    torch.manual_seed(SEED)
    options = config.pop("emulated", None)
    run_config = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan, **config)
    return RoundPipe(
        model, devices=f"emulated:{devices}", model_run_config=run_config, emulated_options=options
    )


def pytorch_with_seeds(
    model: nn.Module, x, y, call: int = 0, num_microbatch: int = 3, scale_grads: bool = True
):
    """Plain PyTorch: ``forward_backward``'s loss of call ``call`` of a model wrapped
    after ``torch.manual_seed(SEED)`` (without ``scale_grads``, the summed microbatch
    losses), each layer seeded as RoundPipe seeds it; leaves the gradients in ``model``."""
    seeds = CallSeeds(SEED)
    for _ in range(call + 1):
        call_seed = seeds.next_call()
    total = torch.zeros((), dtype=torch.float64)
    with torch.random.fork_rng(devices=[]):
        microbatches = weighted_microbatches(x, y, num_microbatch, scale_grads)
        for m, (xm, ym, weight) in enumerate(microbatches):
            h = xm
            for i, layer in enumerate(model):
                torch.manual_seed(layer_seed(microbatch_seed(call_seed, m), i))
                h = layer(h)
            loss = mse_sum(h, ym) * weight
            loss.backward()
            total += loss.detach()
    return total


def grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def assert_matches(pipe_model: nn.Module, reference: nn.Module) -> None:
    for got, want in zip(grads(pipe_model), grads(reference), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def train_steps(pipe: RoundPipe, steps: int = 3) -> list[torch.Tensor]:
    x, y = data()
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.05)
    losses = []
    for _ in range(steps):
        losses.append(pipe.forward_backward((x,), label=y, loss_fn=mse_sum))
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    return losses


def test_runs_with_dropout_on_emulated_devices_are_bit_identical():
    """Three devices drawing at once, in an order the jitter varies: the same seed gives
    the same losses and weights."""
    runs = []
    for jitter_seed in (1, 2):
        model = dropout_model()
        options = EmulatedOptions(jitter_s=2e-3, seed=jitter_seed)
        with wrap(model, recompute_grain="layer", emulated=options) as pipe:
            losses = train_steps(pipe)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    (losses_a, weights_a), (losses_b, weights_b) = runs
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(weights_a, weights_b, strict=True))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_forward_backward_with_dropout_equals_pytorch_drawing_from_the_same_seeds(grain):
    model = dropout_model()
    reference = copy.deepcopy(model)
    x, y = data()
    with wrap(model, recompute_grain=grain) as pipe:
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
    want = pytorch_with_seeds(reference, x, y)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert_matches(model, reference)
    eval_loss = mse_sum(reference.eval()(x), y)
    assert not torch.allclose(loss, eval_loss)  # the masks were drawn


def test_backward_through_a_plain_forward_with_dropout_equals_pytorch():
    model = dropout_model()
    reference = copy.deepcopy(model)
    x, y = data()
    with wrap(model) as pipe:
        out = pipe(x)
        y_parts = y.tensor_split(3)
        loss = sum(mse_sum(o, t) for o, t in zip(out.tensor_split(3), y_parts, strict=True))
        loss.backward()
        pipe.synchronize()
    want = pytorch_with_seeds(reference, x, y, scale_grads=False)  # the loss summed here
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert_matches(model, reference)


def test_dropout_masks_do_not_depend_on_the_plan_or_the_devices():
    x, y = data()
    results = []
    for devices, plan in ((1, "6|1,6"), (3, "1,3|3,2,2"), (2, "2,2|3,1,1,1,1")):
        model = dropout_model()
        with wrap(model, devices=devices, plan=plan) as pipe:
            loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
            pipe.synchronize()
        results.append((loss, grads(model)))
    for loss, got in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-12, atol=1e-12)
        for a, b in zip(got, results[0][1], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_eval_mode_runs_without_dropout_as_in_pytorch():
    model = dropout_model()
    reference = copy.deepcopy(model).eval()
    x, y = data()
    with wrap(model) as pipe:
        pipe.eval()
        assert not any(m.training for m in model.modules())
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        with torch.no_grad():  # per microbatch: a GEMM's rounding may depend on its rows
            expected = torch.cat([reference(xm) for xm in x.tensor_split(3)])
            assert torch.equal(pipe(x), expected)
    total = sum(mse_sum(reference(xm), ym) * w for xm, ym, w in weighted_microbatches(x, y, 3))
    total.backward()
    torch.testing.assert_close(loss, total.detach(), rtol=1e-12, atol=1e-12)
    assert_matches(model, reference)


def test_a_model_wrapped_in_eval_mode_stays_in_it_until_train():
    model = dropout_model().eval()
    with wrap(model) as pipe:
        assert not pipe.training and not model.training
        assert pipe.train() is pipe
        assert pipe.training and all(m.training for m in model.modules())


def test_a_change_of_mode_waits_for_the_backward_in_flight():
    """``forward_backward`` returns before its backward ran; ``eval()`` right after must
    not make that backward's recompute drop the forward's masks."""
    model = dropout_model()
    reference = copy.deepcopy(model)
    x, y = data()
    slow = EmulatedOptions(kernel_time=lambda info: 0.02 if info.kind == "recompute" else 0.0)
    with wrap(model, emulated=slow) as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.eval()
        pipe.synchronize()
    pytorch_with_seeds(reference, x, y)
    assert_matches(model, reference)


def test_a_dropout_switched_on_after_the_first_call_draws_as_in_pytorch():
    """The emulator learned that the first call's layers draw nothing; setting ``p``
    changes the layers, which are then watched again."""
    model = dropout_model(p=0.0)
    reference = copy.deepcopy(model)
    x, y = data()
    with wrap(model) as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pytorch_with_seeds(reference, x, y, call=0)
        for dropout in (model[1], model[4], reference[1], reference[4]):
            dropout.p = 0.5
        loss = pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
    want = pytorch_with_seeds(reference, x, y, call=1)
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=1e-12)
    assert_matches(model, reference)


def run_holding_the_generator_lock(model: nn.Module) -> threading.Thread:
    x, y = data()
    pipe = wrap(model, devices=2)

    def train() -> None:
        with pipe:
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
            pipe.synchronize()

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    thread.join(timeout=1.0)
    return thread


def test_layers_that_draw_nothing_run_without_the_emulated_generator_lock():
    """Compute of models without dropout is not serialised across emulated devices;
    layers that draw wait for the one CPU generator (the guard of this test)."""
    with emulated_random._CPU_RNG_LOCK:
        without = run_holding_the_generator_lock(dropout_model(p=0.0))
        with_dropout = run_holding_the_generator_lock(dropout_model())
        assert not without.is_alive()
        assert with_dropout.is_alive()
    with_dropout.join(timeout=60)
    assert not with_dropout.is_alive()


def test_a_checkpoint_restores_the_seeds_so_a_resumed_run_draws_the_same_masks(tmp_path):
    x, y = data()
    model = dropout_model()
    with wrap(model) as pipe:
        train_steps(pipe, steps=1)
        pipe.save_checkpoint(tmp_path / "ckpt")
        want = [pipe.forward_backward((x,), label=y, loss_fn=mse_sum) for _ in range(2)]
    torch.manual_seed(SEED + 1)  # another seed: the checkpoint's is the one used
    resumed = RoundPipe(dropout_model(), devices="emulated:2")
    with resumed:
        resumed.load_checkpoint(tmp_path / "ckpt")
        got = [resumed.forward_backward((x,), label=y, loss_fn=mse_sum) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))

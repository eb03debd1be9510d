"""A user ``loss_fn``'s loss and gradients do not depend on how the batch is split.

As ``torch.distributed.pipelining`` (``scale_grads=True``): ``forward_backward``
returns, and backpropagates, the mean of the microbatch losses weighted by rows
(microbatch ``i`` of ``r_i`` of the batch's ``R`` rows weighs ``r_i / R``), so a
``loss_fn`` that returns a microbatch's mean gives plain PyTorch's whole-batch mean
on any device or microbatch count. ``RoundPipeRunConfig(scale_grads=False)`` keeps
the sum of the microbatch losses.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.multinode import launch
from support.oracle import assert_grads_close, batch, mlp, mse_sum, train_reference
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

ROWS = 7  # splits unevenly into 2, 3 and 5 microbatches
mse_mean = nn.functional.mse_loss


def whole_batch_mean(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain PyTorch: the mean loss of the whole batch; its gradients left in ``.grad``."""
    loss = mse_mean(model(x), y)
    loss.backward()
    return loss.detach()


def train_once(model: nn.Module, devices: str, config: RoundPipeRunConfig, loss_fn=mse_mean):
    """One ``forward_backward`` of the ``ROWS``-row batch; the loss and the wrapped model
    with its gradients."""
    x, y = batch(size=ROWS)
    with RoundPipe(model, devices=devices, model_run_config=config) as pipe:
        loss = pipe.forward_backward((x,), label=y, loss_fn=loss_fn)
        pipe.synchronize()
    return loss, model


@pytest.mark.parametrize("num_microbatch", [1, 2, 3, 5])
def test_loss_and_gradients_are_the_whole_batch_mean_for_any_microbatch_count(num_microbatch):
    reference = mlp()
    model = copy.deepcopy(reference)
    want = whole_batch_mean(reference, *batch(size=ROWS))
    config = RoundPipeRunConfig(num_microbatch=num_microbatch)
    loss, model = train_once(model, "emulated:2", config)
    torch.testing.assert_close(loss, want, atol=1e-7, rtol=1e-6)
    assert_grads_close(model, reference, atol=1e-7)


def test_a_device_count_change_keeps_the_gradients():
    reference = mlp()
    want = whole_batch_mean(reference, *batch(size=ROWS))
    # The default microbatch count is devices + 1: 3 on two devices, 4 on three.
    for devices in ("emulated:2", "emulated:3"):
        loss, model = train_once(copy.deepcopy(mlp()), devices, RoundPipeRunConfig())
        torch.testing.assert_close(loss, want, atol=1e-7, rtol=1e-6)
        assert_grads_close(model, reference, atol=1e-7)


def loss_weights_of(config: RoundPipeRunConfig, model: nn.Module | None = None):
    """The loss of a ``loss_fn`` returning one per microbatch whatever its rows, and the
    gradient each microbatch's one got (its weight), sorted."""
    seen: list[torch.Tensor] = []

    def one_per_microbatch(output: torch.Tensor, _label) -> torch.Tensor:
        unit = output.sum() * 0 + 1
        unit.register_hook(seen.append)
        return unit

    loss, _ = train_once(model or mlp(), "emulated:2", config, loss_fn=one_per_microbatch)
    return loss, sorted(float(g) for g in seen)


def test_microbatches_are_weighted_by_their_rows():
    loss, weights = loss_weights_of(RoundPipeRunConfig(num_microbatch=3))
    torch.testing.assert_close(loss, torch.tensor(1.0))
    assert weights == pytest.approx([2 / 7, 2 / 7, 3 / 7])  # 7 rows on 3 microbatches


def first_five_then_two(args: tuple, kwargs: dict, num: int) -> list:
    (x,) = args
    return [((x[:5],), kwargs), ((x[5:],), kwargs)]


def test_a_custom_split_is_weighted_by_the_rows_of_its_microbatches():
    config = RoundPipeRunConfig(num_microbatch=2, split_input=first_five_then_two)
    split_label = lambda y, num: [y[:5], y[5:]]  # noqa: E731
    _, weights = loss_weights_of(config.replace(split_label=split_label))
    assert weights == pytest.approx([2 / 7, 5 / 7])


class AddBias(nn.Module):
    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return x + bias


def test_microbatches_whose_rows_cannot_be_told_weigh_the_same():
    def with_a_bias_of_other_rows(args: tuple, kwargs: dict, num: int) -> list:
        return [(a, {"bias": torch.ones(8)}) for a, _ in first_five_then_two(args, kwargs, num)]

    config = RoundPipeRunConfig(
        num_microbatch=2,
        split_input=with_a_bias_of_other_rows,
        split_label=lambda y, num: [y[:5], y[5:]],
    )
    _, weights = loss_weights_of(config, nn.Sequential(AddBias(), *mlp()))
    assert weights == pytest.approx([1 / 2, 1 / 2])  # a bias of 8 rows beside 5 or 2


def test_scale_grads_false_keeps_the_sum_of_microbatch_losses():
    reference = mlp()
    x, y = batch(size=ROWS)
    want = torch.zeros(())
    for xm, ym in zip(x.tensor_split(3), y.tensor_split(3), strict=True):
        loss = mse_mean(reference(xm), ym)
        loss.backward()
        want += loss.detach()
    config = RoundPipeRunConfig(num_microbatch=3, scale_grads=False)
    loss, model = train_once(copy.deepcopy(mlp()), "emulated:2", config)
    torch.testing.assert_close(loss, want, atol=1e-6, rtol=1e-6)
    assert_grads_close(model, reference, atol=1e-6)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("grad_reduction", ["sum", "mean"])
def test_nodes_with_uneven_shares_train_on_the_global_batchs_mean(tmp_path, grad_reduction):
    # 13 rows: rank 0 holds 7 (microbatches of 4 and 3), rank 1 six (3 and 3), the
    # microbatches one process makes of the whole batch; each weighs r_i / 13.
    codes, results, outputs = launch(
        "train", 2, tmp_path, steps=2, batch_size=13, grad_reduction=grad_reduction
    )
    assert codes == [0, 0], outputs
    batches = [tuple(t.double() for t in batch(seed=s, size=13)) for s in range(2)]
    adam = lambda params: torch.optim.Adam(params, lr=0.01)  # noqa: E731 - the scenario's
    want, want_losses = train_reference(mlp().double(), batches, 4, adam, loss_fn=mse_sum)
    for result in results:
        assert result["losses"] == pytest.approx(want_losses, rel=1e-6)
        for name, value in want.state_dict().items():
            torch.testing.assert_close(result["state"][name], value, rtol=1e-10, atol=1e-12)


def test_scale_grads_must_be_a_bool():
    with pytest.raises(TypeError, match="scale_grads must be True or False"):
        RoundPipeRunConfig(scale_grads="mean")

"""After a device out-of-memory error the model is usable again: the failed call's
device memory is all given back (nothing keeps its tensors: not the error's traceback,
not the failed jobs' records), and a smaller batch then trains exactly as in PyTorch,
with sync and async steps, whether the error came from a forward stage (raised by the
call itself) or from a stage that runs after the loss is known (raised later)."""

from __future__ import annotations

import pytest
import torch
from support.device_memory import (
    NUM_MICROBATCH,
    batches,
    drained,
    emulated_pipe,
    model_hungry_in,
)
from support.oracle import assert_weights_close, mse_sum, train_reference


def sgd(params):
    return torch.optim.SGD(params, lr=0.01)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_after_out_of_memory_a_smaller_batch_trains_like_pytorch(phase, is_async, no_hang):
    module = model_hungry_in(phase)
    small = batches([1, 2, 3], size=4)
    # the failed call leaves no trace: PyTorch trains on the small batches only
    expected, losses = train_reference(module, small, NUM_MICROBATCH, sgd, stale=is_async)
    with emulated_pipe(module) as pipe:
        optimizer = sgd(pipe.optim_parameters())

        def step() -> None:
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=is_async)

        x, y = batches([0], size=64)[0]
        with pytest.raises(torch.OutOfMemoryError):
            no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
            no_hang(step)
            no_hang(pipe.synchronize)
        assert [drained(device) for device in pipe.pool] == [0, 0]

        got = []
        for x, y in small:
            got.append(float(no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)))
            no_hang(step)
        no_hang(pipe.synchronize)
    assert got == pytest.approx(losses, rel=1e-5)
    assert_weights_close(module, expected)

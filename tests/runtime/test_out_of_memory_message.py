"""A device out-of-memory error says once where it happened and once what to try,
however many of the runtime's threads handed it on."""

from __future__ import annotations

import re

import pytest
import torch
from support.device_memory import batches, emulated_pipe, model_hungry_in
from support.oracle import mse_sum


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_an_out_of_memory_error_names_its_stage_and_gives_its_advice_once(phase, no_hang):
    x, y = batches([0], size=64)[0]
    with (
        emulated_pipe(model_hungry_in(phase)) as pipe,
        pytest.raises(torch.OutOfMemoryError) as caught,
    ):
        no_hang(pipe.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(pipe.synchronize)
    message = str(caught.value)
    assert len(re.findall(r"(forward|fused|backward) stage \d+ \(layers", message)) == 1, message
    assert message.count("Try more microbatches") == 1, message

"""Inside ``step_fn``, ``pipe.parameters()`` are the master parameters, whose gradients
the step applies: ``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` clips them
and returns their norm, as it does for a plain PyTorch model. On several nodes, where
each node's masters are its share of the model and a norm over them would miss the
other nodes' gradients, it is refused."""

from __future__ import annotations

import copy

import torch
from support.multinode import launch
from support.oracle import assert_weights_close, batch, mlp, mse_sum, reference_loss_and_grads

from roundpipe import RoundPipeRunConfig

NUM_MICROBATCH = 3
MAX_NORM = 0.5


def test_clip_grad_norm_over_pipe_parameters_in_step_fn_clips_the_gradients_the_step_applies(
    wrap, no_hang
):
    config = RoundPipeRunConfig(num_microbatch=NUM_MICROBATCH, execute_plan="2,2|2,2,2")
    model, reference = wrap(mlp(), devices="emulated:2", model_run_config=config)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    norms = []

    def step_fn() -> None:
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        optimizer.step()
        optimizer.zero_grad()

    x, y = batch()
    no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    no_hang(model.step, step_fn, is_async=False)
    no_hang(model.synchronize)

    expected = copy.deepcopy(reference)
    reference_loss_and_grads(expected, x, y, NUM_MICROBATCH)
    norm = torch.nn.utils.clip_grad_norm_(expected.parameters(), MAX_NORM)
    torch.optim.SGD(expected.parameters(), lr=0.1).step()
    assert norm > MAX_NORM  # the clip matters
    torch.testing.assert_close(norms[0], norm)
    assert_weights_close(model.model, expected)


def test_pipe_parameters_in_step_fn_on_several_nodes_is_refused_naming_pipe_clip_grad_norm(
    tmp_path,
):
    codes, results, outputs = launch("parameters_in_step_fn", 2, tmp_path)
    assert codes == [0, 0], outputs
    for result in results:
        assert "this node's share" in result["error"]
        assert "pipe.clip_grad_norm_(max_norm)" in result["error"]

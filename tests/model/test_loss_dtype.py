"""The loss ``forward_backward`` returns has the dtype ``loss_fn`` returned, as in
PyTorch: a float64 model's loss keeps its float64 precision."""

from __future__ import annotations

import pytest
import torch
from support.oracle import batch, mlp, mse_sum, reference_loss_and_grads

from roundpipe import RoundPipeRunConfig


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_the_loss_has_the_dtype_and_precision_loss_fn_returned(dtype, wrap, no_hang):
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan="2,2|2,2,2")
    model, reference = wrap(mlp().to(dtype), devices="emulated:2", model_run_config=config)
    x, y = (t.to(dtype) for t in batch())
    loss = no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
    want = reference_loss_and_grads(reference, x, y, 3)
    assert loss.dtype == dtype
    tolerance = torch.finfo(dtype).eps * 16
    torch.testing.assert_close(loss, want.to(dtype), rtol=tolerance, atol=0)

"""The size ``roundpipe train`` tells a full disk a checkpoint needs.

Oracle: the bytes ``save_checkpoint`` writes for the trainable weights, the masters and
the optimizer (``weights``, ``masters`` and ``optimizer`` safetensors files), for fp32
AdamW and for the 8-bit AdamW, whose state is codes and scales, not fp32 tensors.
"""

from __future__ import annotations

import pytest
import torch
from support.oracle import batch, mlp, mse_sum

from roundpipe import RoundPipe
from roundpipe.train.checkpoints import checkpoint_bytes

pytest.importorskip("torchao")
from roundpipe.optim import make_adamw  # noqa: E402


@pytest.mark.parametrize("states", ["fp32", "int8"])
def test_the_estimate_is_what_the_checkpoint_stores(states, tmp_path, no_hang):
    model = mlp(width=256, depth=4).to(torch.bfloat16)  # tensors 8-bit states quantize
    with RoundPipe(model, devices="emulated:2") as pipe:
        optimizer = make_adamw(pipe.optim_parameters(), lr=1e-3, states=states)
        x, y = batch()
        no_hang(pipe.forward_backward, (x.bfloat16(),), label=y.bfloat16(), loss_fn=mse_sum)
        no_hang(pipe.step, lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        no_hang(pipe.save_checkpoint, tmp_path / "ckpt", optimizer=optimizer)
        masters = list(pipe.optim_parameters())
        estimate = checkpoint_bytes([*model.parameters(), *masters], optimizer)
    stored = sum((tmp_path / "ckpt" / f"{n}.safetensors").stat().st_size
                 for n in ("weights", "masters", "optimizer"))  # fmt: skip
    assert 0.9 * stored <= estimate <= 1.05 * stored

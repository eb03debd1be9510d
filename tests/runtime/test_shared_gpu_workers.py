"""Several workers on one GPU (``devices="cuda:0,0"``) are separate devices to the
runtime: each keeps its own layer shells (two issue threads binding one shell at once
would run one stage with the other's weights). The emulator numbers its devices 0..N-1,
so the test gives two emulated workers one GPU number, as ``cuda:0,0`` does."""

from __future__ import annotations

import torch
from torch import nn

from roundpipe import RoundPipe
from roundpipe.core.config import RoundPipeRunConfig
from roundpipe.core.plan import Plan


def test_workers_sharing_a_gpu_number_keep_their_own_shells():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    config = RoundPipeRunConfig(execute_plan=Plan.parse("1|2,1"))
    with RoundPipe(model, devices="emulated:2", model_run_config=config) as pipe:
        for device in pipe.pool:
            device.index = 0  # one GPU, two workers
        for _ in range(2):  # the second call's stages run on the other worker
            x, y = torch.randn(4, 4), torch.randn(4, 2)
            pipe.forward_backward((x,), label=y, loss_fn=nn.functional.mse_loss)
        pipe.synchronize()
        shells = [len(layer._shells) for layer in pipe.runtime.layers]
    assert shells == [2, 2, 2]

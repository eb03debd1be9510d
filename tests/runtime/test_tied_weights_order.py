"""A weight tied between layers (an embedding and its LM head) gets the same gradient
bit for bit whatever the plan: whether its uses run in one stage or in two, each use's
gradient reaches the master on its own, so the sum does not depend on how stages cut
the model (a resumed run, whose automatic plan may differ, continues bit for bit)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roundpipe import RoundPipe
from roundpipe.core.config import RoundPipeRunConfig
from roundpipe.core.plan import Plan


class Tied(nn.Module):
    """Four layers; the first and the last use one weight."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 16)
        )
        self.layers[3].weight = self.layers[0].weight


def gradients(plan: str) -> dict[str, torch.Tensor]:
    model = Tied().layers
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=Plan.parse(plan))
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(9, 16, generator=generator)
    y = torch.randn(9, 16, generator=generator)
    with RoundPipe(model, devices="emulated:2", model_run_config=config) as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=nn.functional.mse_loss)
        pipe.synchronize()
        return {name: p.grad.clone() for name, p in pipe.optim_named_parameters()}


@pytest.mark.parametrize("other", ["1|3,1", "2|2,1,1", "1,1,1|1,1,1,1"])
def test_a_tied_weights_gradient_does_not_depend_on_the_plan(other):
    one_stage = gradients("|4")  # both uses in the fused stage
    split = gradients(other)  # the uses in different stages
    assert one_stage.keys() == split.keys()
    for name in one_stage:
        assert torch.equal(one_stage[name], split[name]), name

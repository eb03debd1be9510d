"""A parameter without a flat view (a transposed weight, a column slice of a larger
tensor) steps under ``make_adamw``'s lean optimizers as under their oracles, bit for bit,
and is updated in place: the same object, storage and strides.

The transposed weight (256 x 32) and the slice (64 x 64 of 64 x 80) have quantized
8-bit moments (>= 4096 values); the small transposed one (8 x 5) keeps plain moments.
Each layout's first torchao step compiles a kernel (a few seconds).
"""

from __future__ import annotations

import pytest
import torch

from roundpipe.optim import make_adamw

torchao_optim = pytest.importorskip("torchao.optim")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

OPTIONS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def make_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    """A transposed weight, a column slice of a larger tensor, a small transposed one."""
    generator = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=generator) * 0.1).to(dtype)

    params = [randn(32, 256).t(), randn(64, 80)[:, 8:72], randn(5, 8).t()]
    assert not any(p.is_contiguous() for p in params)
    return [torch.nn.Parameter(p) for p in params]


def run(optimizer, params, steps: int = 3) -> list[torch.Tensor]:
    """``steps`` steps with gradients laid out as autograd lays them out (the parameter's
    strides where it is dense, else contiguous)."""
    layouts = [(p.data_ptr(), p.stride()) for p in params]
    for step in range(steps):
        generator = torch.Generator().manual_seed(100 + step)
        for param in params:
            grad = torch.randn(param.shape, generator=generator) * 1e-2
            param.grad = torch.empty_like(param).copy_(grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    assert [(p.data_ptr(), p.stride()) for p in params] == layouts  # stepped in place
    return [p.detach().clone() for p in params]


def assert_equal(got, want):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"parameter {i} differs"


class _StatesOf(torchao_optim._AdamW):
    """torchao's AdamW step over moments of ``state_dtype`` (the oracle of bf16 states
    of fp32 masters, as in test_lean_optimizers.py)."""

    state_dtype = torch.bfloat16

    def _new_buffer(self, p, signed):
        return torch.zeros(p.shape, dtype=self.state_dtype)


def test_int8_states_of_non_contiguous_parameters_equal_torchao_adamw8bit():
    params, reference = make_params(), make_params()
    optimizer = make_adamw(params, states="int8", **OPTIONS)
    want = run(torchao_optim.AdamW8bit(reference, **OPTIONS), reference)
    assert_equal(run(optimizer, params), want)
    kinds = [type(optimizer.state[p]["exp_avg"]).__name__ for p in params]
    assert kinds == ["OptimState8bit", "OptimState8bit", "Tensor"]


def test_bf16_states_of_non_contiguous_parameters_equal_torchaos_adamw_step():
    params, reference = make_params(), make_params()
    optimizer = make_adamw(params, states="bf16", **OPTIONS)
    assert_equal(run(optimizer, params), run(_StatesOf(reference, **OPTIONS), reference))


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_stochastic_rounding_of_non_contiguous_parameters_equals_contiguous_ones(states):
    """The random bits follow the parameter's logical order, not its memory."""
    params = make_params(torch.bfloat16)
    contiguous = [torch.nn.Parameter(p.detach().contiguous()) for p in make_params(torch.bfloat16)]
    options = {"states": states, "stochastic_round": True, "seed": 5, **OPTIONS}
    want = run(make_adamw(contiguous, **options), contiguous)
    assert_equal(run(make_adamw(params, **options), params), want)

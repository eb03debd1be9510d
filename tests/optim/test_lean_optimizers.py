"""``roundpipe.optim``: ``make_adamw`` picks, for each choice of masters and states, the
class that does it; each equals its oracle (plain PyTorch or torchao's own optimizer on
the same parameters and gradients), bit for bit; stochastic rounding is deterministic
and leaves the process's generator alone.

The 2-D weights are 64 x 64 (torchao quantizes only states of >= 4096 values) and
32 x 256; the 1-D one stays below the threshold (plain states). Each shape's first
torchao step compiles a kernel (a few seconds).
"""

from __future__ import annotations

import sys

import pytest
import torch

from roundpipe.optim import make_adamw

torchao_optim = pytest.importorskip("torchao.optim")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

SHAPES = [(64, 64), (32, 256), (40,)]
OPTIONS = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def make_params(dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter((torch.randn(shape, generator=generator) * 0.1).to(dtype))
        for shape in SHAPES
    ]


def gradients(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(shape, generator=generator) * 1e-2).to(dtype) for shape in SHAPES]


def run(optimizer, params, steps: int = 3) -> list[torch.Tensor]:
    for step in range(steps):
        for param, grad in zip(params, gradients(step, params[0].dtype), strict=True):
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in params]


def groups_of(params):
    return [
        {"params": params[:2], "weight_decay": OPTIONS["weight_decay"]},
        {"params": params[2:], "weight_decay": 0.0},
    ]


def assert_equal(got, want):
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs"


def dequantized(optimizer, params, key):
    return [
        torch.as_tensor(
            getattr(optimizer.state[p][key], "dequantize", optimizer.state[p][key].clone)()
        )
        .float()
        .reshape(p.shape)
        for p in params
    ]


# -- which class, and the plain-PyTorch cases ------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matching_states_are_torch_fused_adamw_bit_for_bit(dtype):
    params, reference = make_params(dtype), make_params(dtype)
    states = "fp32" if dtype is torch.float32 else "bf16"
    optimizer = make_adamw(groups_of(params), states=states, **OPTIONS)
    assert type(optimizer) is torch.optim.AdamW and optimizer.defaults["fused"]
    oracle = torch.optim.AdamW(groups_of(reference), **OPTIONS, fused=True)
    assert optimizer.defaults == oracle.defaults  # roundpipe train's optimizer until now
    assert_equal(run(optimizer, params), run(oracle, reference))
    assert optimizer.state[params[0]]["exp_avg"].dtype is dtype


# -- torchao's classes -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_states_equal_torchao_adamw8bit_bit_for_bit(dtype):
    from roundpipe.optim import AdamW8bit

    params, reference = make_params(dtype), make_params(dtype)
    optimizer = make_adamw(groups_of(params), states="int8", **OPTIONS)
    assert type(optimizer) is AdamW8bit
    oracle = torchao_optim.AdamW8bit(groups_of(reference), **OPTIONS)
    want = run(oracle, reference)
    assert_equal(run(optimizer, params), want)
    state = optimizer.state[params[0]]["exp_avg"]
    assert type(state).__name__ == "OptimState8bit" and state.shape == (64 * 64,)
    for key in ("exp_avg", "exp_avg_sq"):
        assert_equal(dequantized(optimizer, params, key), dequantized(oracle, reference, key))


class _StatesOf(torchao_optim._AdamW):
    """The oracle of other state dtypes: torchao's own AdamW step over buffers of
    ``state_dtype`` in the parameters' shape."""

    state_dtype = torch.float32

    def _new_buffer(self, p, signed):
        return torch.zeros(p.shape, dtype=self.state_dtype)


@pytest.mark.parametrize(("dtype", "states"), [(torch.float32, "bf16"), (torch.bfloat16, "fp32")])
def test_other_state_dtypes_equal_torchaos_adamw_step(dtype, states):
    from roundpipe.optim import AdamW

    params, reference = make_params(dtype), make_params(dtype)
    optimizer = make_adamw(groups_of(params), states=states, **OPTIONS)
    assert type(optimizer) is AdamW
    oracle = _StatesOf(groups_of(reference), **OPTIONS)
    oracle.state_dtype = optimizer.state_dtype
    assert_equal(run(optimizer, params), run(oracle, reference))
    assert optimizer.state[params[0]]["exp_avg"].dtype is optimizer.state_dtype
    for key in ("exp_avg", "exp_avg_sq"):
        assert_equal(dequantized(optimizer, params, key), dequantized(oracle, reference, key))


def test_a_float_lr_set_by_hand_is_taken():
    params = make_params()
    optimizer = make_adamw(params, states="int8", **OPTIONS)
    optimizer.param_groups[0]["lr"] = 0.0
    before = [p.detach().clone() for p in params]
    assert_equal(run(optimizer, params, steps=1), [p * (1 - 0.0 * 0.1) for p in before])
    assert isinstance(optimizer.param_groups[0]["lr"], torch.Tensor)


def test_the_table_quantizer_equals_torchaos_binary_search():
    """On every threshold and its four fp32 neighbours each side, the map's own values,
    and random values over all magnitudes."""
    import numpy as np
    from torchao.optim.quant_utils import quantize_8bit_with_qmap
    from torchao.optim.subclass_8bit import get_qmap_signed, get_qmap_unsigned

    from roundpipe.optim.quant8 import quantize, tables, thresholds

    generator = torch.Generator().manual_seed(0)
    for signed, values in ((True, get_qmap_signed()), (False, get_qmap_unsigned())):
        qmap = torch.tensor(values)
        edges = torch.from_numpy(thresholds(np.asarray(values, dtype=np.float32)))
        xs, down, up = [edges, qmap], edges, edges
        for _ in range(4):
            down = torch.nextafter(down, torch.tensor(-2.0))
            up = torch.nextafter(up, torch.tensor(2.0))
            xs += [down, up]
        wide = torch.randn(200_000, generator=generator)
        wide = wide * torch.exp(torch.randn(200_000, generator=generator) * 6)
        xs += [wide.clamp(-1, 1), torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30])]
        x = torch.cat(xs).clamp(-1 if signed else 0, 1)
        want = quantize_8bit_with_qmap(x, qmap)
        assert torch.equal(quantize(x, *tables(values)), want), f"signed={signed}"


@pytest.mark.slow  # ~30 s: compiles the step for each shape
def test_the_compiled_step_without_the_kernel_equals_torchao_too(monkeypatch):
    from roundpipe.optim import _kernel

    monkeypatch.setattr(_kernel, "load", lambda: None)
    params, reference = make_params(), make_params()
    optimizer = make_adamw(params, states="int8", **OPTIONS)
    oracle = torchao_optim.AdamW8bit(reference, **OPTIONS)
    assert_equal(run(optimizer, params), run(oracle, reference))
    runs, state = [], torch.get_rng_state()  # its rounding: from its own generator
    for _ in range(2):
        params = make_params(torch.bfloat16)
        optimizer = make_adamw(params, states="int8", stochastic_round=True, seed=1, **OPTIONS)
        runs.append(run(optimizer, params))
    assert torch.equal(torch.get_rng_state(), state)
    assert_equal(runs[0], runs[1])


# -- stochastic rounding ---------------------------------------------------------------


def test_the_rounding_is_torchaos_with_the_same_random_bits():
    from torchao.optim.quant_utils import _fp32_to_bf16_sr

    from roundpipe.optim.lean import round_bf16_stochastic

    x = torch.randn(10_000, generator=torch.Generator().manual_seed(3))
    torch.manual_seed(5)
    want = _fp32_to_bf16_sr(x)
    bits = torch.randint(
        0, 1 << 16, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(5)
    )
    assert_equal([round_bf16_stochastic(x, bits)], [want])


@pytest.mark.parametrize("states", ["bf16", "int8"])
def test_stochastic_rounding_is_deterministic_and_unbiased(states):
    runs = []
    state = torch.get_rng_state()
    for seed in (7, 7, 8):
        params = make_params(torch.bfloat16)
        optimizer = make_adamw(params, states=states, stochastic_round=True, seed=seed, **OPTIONS)
        runs.append(run(optimizer, params))
    assert torch.equal(torch.get_rng_state(), state)  # the process's generator: untouched
    assert_equal(runs[0], runs[1])
    assert not torch.equal(runs[0][0], runs[2][0])

    # One step from the same bf16 weights: each result is one of the two bf16 values
    # around torchao's fp32 update (the same step on an fp32 copy).
    params = make_params(torch.bfloat16)
    exact = [p.detach().float() for p in make_params(torch.bfloat16)]
    exact = [torch.nn.Parameter(p) for p in exact]
    rounded = run(
        make_adamw(params, states=states, stochastic_round=True, seed=1, **OPTIONS), params, 1
    )
    cls = torchao_optim.AdamW8bit if states == "int8" else _StatesOf
    oracle = cls(exact, **OPTIONS)
    if states == "bf16":
        oracle.state_dtype = torch.bfloat16
    for param, grad in zip(exact, gradients(0, torch.bfloat16), strict=True):
        param.grad = grad.float()
    oracle.step()
    for got, want in zip(rounded, exact, strict=True):
        bits = want.detach().view(torch.int32)
        down = (bits & -65536).view(torch.float32)
        up = ((bits & -65536) + 0x10000).view(torch.float32)
        got, want = got.float(), want.detach()
        assert torch.all((got == down) | (got == up))
        # Unbiased: the mean rounding error is small against the mean gap.
        assert (got - want).mean().abs() < 0.05 * (up - down).abs().mean()


# -- refusals --------------------------------------------------------------------------


def test_refusals_name_what_is_allowed(monkeypatch):
    with pytest.raises(ValueError, match="states='int4'.*'fp32', 'bf16', 'int8'"):
        make_adamw(make_params(), lr=1e-3, states="int4")
    with pytest.raises(ValueError, match="stochastic_round=True rounds bf16.*fp32"):
        make_adamw(make_params(), lr=1e-3, states="int8", stochastic_round=True)
    mixed = [make_params()[0], make_params(torch.bfloat16)[1]]
    with pytest.raises(ValueError, match="fp32 or bf16 masters.*bfloat16.*float32"):
        make_adamw(mixed, lr=1e-3)
    with pytest.raises(ValueError, match="float16"):
        make_adamw(make_params(torch.float16), lr=1e-3)
    monkeypatch.setitem(sys.modules, "roundpipe.optim.lean", None)
    with pytest.raises(ImportError, match=r"torchao.*pip install 'roundpipe-ft\[torchao\]'"):
        make_adamw(make_params(), lr=1e-3, states="int8")
    make_adamw(make_params(), lr=1e-3)  # fp32 states need no torchao


# -- in a pipe: checkpoints, and the devices' random numbers -----------------------------


def dropout_mlp(seed: int, dtype: torch.dtype) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(8, 64), torch.nn.Dropout(0.2), torch.nn.Tanh()]
    layers += [torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4)]
    return torch.nn.Sequential(*layers).to(dtype)


def train_pipe(pipe, optimizer, seeds, dtype) -> None:
    from support.oracle import batch, mse_sum

    for seed in seeds:
        x, y = batch(seed)
        pipe.forward_backward((x.to(dtype),), label=y.to(dtype), loss_fn=mse_sum)
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=True)


@pytest.mark.parametrize(
    ("masters", "states"), [("fp32", "int8"), ("bf16", "int8"), ("bf16", "fp32")]
)
def test_a_checkpoint_resumes_bit_for_bit_with_dropout_and_async_steps(tmp_path, masters, states):
    """The devices draw dropout masks while the optimizer thread steps (and, with bf16
    masters, rounds stochastically): a resumed run equals the uninterrupted one."""
    from roundpipe import RoundPipe, RoundPipeRunConfig

    dtype = torch.bfloat16 if masters == "bf16" else torch.float32
    options = {"states": states, "stochastic_round": masters == "bf16", "seed": 3}

    def pipe_of(seed):
        config = RoundPipeRunConfig(num_microbatch=2)
        model = dropout_mlp(seed, dtype)
        return RoundPipe(model, devices="emulated:2", optim_dtype=dtype, model_run_config=config)

    path = tmp_path / "ckpt"
    with pipe_of(0) as pipe:
        optimizer = make_adamw(pipe.optim_parameters(), **OPTIONS, **options)
        train_pipe(pipe, optimizer, range(2), dtype)
        pipe.save_checkpoint(path, optimizer)
        train_pipe(pipe, optimizer, range(2, 5), dtype)
        pipe.synchronize()
        want = [p.detach().clone() for p in pipe.model.parameters()]
        kinds = {type(v).__name__ for s in optimizer.state.values() for v in s.values()}
        dtypes = {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"}
    assert ("OptimState8bit" in kinds) == (states == "int8")
    with pipe_of(7) as pipe:
        optimizer = make_adamw(pipe.optim_parameters(), **OPTIONS, **options)
        pipe.load_checkpoint(path, optimizer)
        loaded = {v.dtype for s in optimizer.state.values() for k, v in s.items() if k != "step"}
        train_pipe(pipe, optimizer, range(2, 5), dtype)
        pipe.synchronize()
        got = [p.detach().clone() for p in pipe.model.parameters()]
    assert loaded == dtypes  # fp32 moments of bf16 masters stay fp32
    assert_equal(got, want)

"""torchao's 8-bit AdamW on RoundPipe's masters: its steps equal plain PyTorch's, bit for
bit, sync and async, and its state (a tensor ``lr``, quantized moments) round-trips
through a checkpoint so that a resumed run continues bit for bit.

The model is tiny but has one 64x64 weight: torchao quantizes only states of at least
4096 values (smaller ones stay fp32), so both kinds are exercised. The first torchao
step compiles its kernel (a few seconds per parameter shape).
"""

from __future__ import annotations

import copy
import importlib
import json

import pytest
import torch
from support.multinode import launch
from support.oracle import batch, mlp, mse_sum, train_reference

from roundpipe import RoundPipe, RoundPipeRunConfig

torchao_optim = pytest.importorskip("torchao.optim")
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

CONFIG = RoundPipeRunConfig(num_microbatch=2)


def model8() -> torch.nn.Sequential:
    return mlp(seed=0, width=64, depth=4)  # 8 -> 64 -> Tanh -> 64 -> 4


def adamw8bit(params):
    return torchao_optim.AdamW8bit(params, lr=1e-2, weight_decay=0.1)


def pipe_of(model: torch.nn.Module) -> RoundPipe:
    return RoundPipe(model, devices="emulated:2", model_run_config=CONFIG)


def train(pipe: RoundPipe, optimizer, seeds, is_async: bool) -> None:
    for seed in seeds:
        x, y = batch(seed)
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=is_async)


def weights(pipe: RoundPipe) -> list[torch.Tensor]:
    pipe.synchronize()
    return [p.detach().clone() for p in pipe.model.parameters()]


def assert_equal(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"parameter {i} differs"


@pytest.mark.parametrize("is_async", [False, True])
def test_adamw8bit_steps_equal_plain_pytorch(is_async):
    model = model8()
    batches = [batch(seed) for seed in range(4)]
    reference, _ = train_reference(model, batches, 2, adamw8bit, stale=is_async)
    with pipe_of(copy.deepcopy(model)) as pipe:
        optimizer = adamw8bit(pipe.optim_parameters())
        train(pipe, optimizer, range(4), is_async)
        got = weights(pipe)
        kinds = {type(v).__name__ for s in optimizer.state.values() for v in s.values()}
    assert "OptimState8bit" in kinds  # the 64x64 weight's moments really are 8-bit
    assert_equal(got, [p.detach() for p in reference.parameters()])


@pytest.mark.parametrize("is_async", [False, True])
def test_an_adamw8bit_checkpoint_resumes_bit_for_bit(tmp_path, is_async):
    path = tmp_path / "ckpt"
    with pipe_of(model8()) as pipe:
        optimizer = adamw8bit(pipe.optim_parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        train(pipe, optimizer, range(2), is_async)
        pipe.step(scheduler.step, is_async=is_async)
        x, y = batch(99)
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)  # gradients not stepped yet
        pipe.save_checkpoint(path, optimizer, scheduler)
        train(pipe, optimizer, range(2, 5), is_async)
        want = weights(pipe)

    record = json.loads((path / "state.json").read_text())["optimizer"]
    assert all("lr" not in group for group in record["param_groups"])  # a tensor: not JSON
    torch.manual_seed(1234)
    with pipe_of(mlp(seed=7, width=64, depth=4)) as pipe:
        optimizer = adamw8bit(pipe.optim_parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        pipe.load_checkpoint(path, optimizer, scheduler)
        lr = optimizer.param_groups[0]["lr"]
        assert (
            isinstance(lr, torch.Tensor)
            and lr.dtype == torch.float32
            and lr.item() == pytest.approx(5e-3)
        )
        state = optimizer.state[list(pipe.optim_parameters())[2]]
        assert type(state["exp_avg"]).__name__ == "OptimState8bit"
        assert state["exp_avg"].signed and not state["exp_avg_sq"].signed
        train(pipe, optimizer, range(2, 5), is_async)
        got = weights(pipe)
    assert_equal(got, want)


class Marked(torch.Tensor):
    """A tensor subclass no checkpoint knows."""


def test_an_unknown_state_subclass_is_refused_before_anything_is_written(tmp_path):
    path = tmp_path / "ckpt"
    with pipe_of(model8()) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.1, momentum=0.9)
        train(pipe, optimizer, range(1), is_async=False)
        pipe.synchronize()
        first = next(iter(pipe.optim_parameters()))
        optimizer.state[first]["momentum_buffer"] = torch.zeros(3).as_subclass(Marked)
        with pytest.raises(TypeError, match="momentum_buffer.*Marked"):
            pipe.save_checkpoint(path, optimizer)
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "kind", ["8bit.OptimState8bit", "4bit.OptimState4bit", "fp8.OptimStateFp8"]
)
def test_each_known_state_subclass_round_trips_and_no_other_class_loads(tmp_path, kind):
    """Below the pipe (no step, nothing compiled): the optimizer's part of a checkpoint
    rebuilds a quantized state exactly, and refuses a record naming another class."""
    from roundpipe.model import checkpoint_optimizer as part

    param = torch.nn.Parameter(torch.zeros(64, 64))
    optimizer = torch.optim.SGD([param], lr=torch.tensor(0.5))
    module, name = kind.split(".")
    cls = getattr(importlib.import_module(f"torchao.optim.subclass_{module}"), name)
    zeros = cls.zeros if module == "fp8" else lambda *a: cls.zeros(*a[:1], True, *a[1:])
    state = zeros(param.shape, 128)
    state.copy_(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
    optimizer.state[param]["momentum_buffer"] = state
    tensors, rest = part.split(optimizer)
    json.dumps(rest)
    loaded = part.staged(tmp_path, tensors, rest, optimizer)
    got = loaded["state"][0]["momentum_buffer"]
    assert type(got) is cls and got.shape == state.shape
    assert torch.equal(got.dequantize(), state.dequantize())
    assert isinstance(loaded["param_groups"][0]["lr"], torch.Tensor)

    rest["subclasses"]["0/momentum_buffer"]["class"] = "os.system"
    with pytest.raises(ValueError, match="os.system.*does not load"):
        part.staged(tmp_path, tensors, rest, optimizer)


@pytest.mark.slow  # 45-65 s: two processes, each compiling torchao's step
def test_adamw8bit_on_two_nodes_resumes_bit_for_bit(tmp_path):
    """Each rank's AdamW8bit steps the tensors it owns (the 64x64 weight's owner keeps
    8-bit moments) and saves them in its shard; the reloaded run continues exactly."""
    checkpoint = tmp_path / "ckpt"
    runs = {}
    for phase in ("save", "load"):
        out = tmp_path / phase
        out.mkdir()
        codes, results, outputs = launch(
            "low_bit_resume", 2, out, timeout=300, checkpoint=str(checkpoint), phase=phase
        )
        assert codes == [0, 0], outputs
        runs[phase] = results
    assert any("OptimState8bit" in result["kinds"] for result in runs["load"])
    for saved, loaded in zip(runs["save"], runs["load"], strict=True):
        for name, tensor in saved["state"].items():
            assert torch.equal(tensor, loaded["state"][name]), name

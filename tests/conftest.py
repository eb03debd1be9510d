"""Fixtures shared by the runtime tests: a hang guard, auto-closed models, the PyTorch
oracle, and the six-layer model with a faulty layer (``support/faults.py``)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support import faults
from support.oracle import (
    assert_grads_close,
    assert_weights_close,
    batch,
    mse_sum,
    reference_loss_and_grads,
)
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

HANG_LIMIT_S = 30.0


@pytest.fixture
def no_hang() -> Callable[..., Any]:
    """``no_hang(fn, *args, **kwargs)`` calls ``fn`` on a helper thread and returns its result.

    Its exception is re-raised here; if it has not returned within ``HANG_LIMIT_S``
    seconds the test fails instead of hanging the suite.
    """

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["value"] = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
                outcome["error"] = exc

        thread = threading.Thread(target=target, name="test-no-hang", daemon=True)
        thread.start()
        thread.join(HANG_LIMIT_S)
        if thread.is_alive():
            name = getattr(fn, "__qualname__", repr(fn))
            pytest.fail(f"{name} did not return within {HANG_LIMIT_S:.0f} s (a hang)")
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("value")

    return run


@pytest.fixture
def error_of(no_hang) -> Callable[..., BaseException]:
    """``error_of(fn, *args, **kwargs)``: the exception ``fn`` raises (fails if none, or a hang)."""

    def run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> BaseException:
        with pytest.raises(Exception) as caught:
            no_hang(fn, *args, **kwargs)
        return caught.value

    return run


@pytest.fixture
def wrap(no_hang) -> Iterator[Callable[..., tuple[RoundPipe, nn.Module]]]:
    """``wrap(module, **options)`` -> ``(RoundPipe(module, ...), untouched copy of module)``.

    Every model built this way is closed when the test ends.
    """
    models: list[RoundPipe] = []

    def build(module: nn.Module, **options: Any) -> tuple[RoundPipe, nn.Module]:
        reference = copy.deepcopy(module)
        model = RoundPipe(module, **options)
        models.append(model)
        return model, reference

    yield build
    for model in models:
        no_hang(model.close)


@pytest.fixture
def trains_like_pytorch(no_hang) -> Callable[[RoundPipe, nn.Module], None]:
    """``trains_like_pytorch(model, reference)`` asserts one call of ``model`` equals PyTorch.

    One ``forward_backward`` + ``synchronize()`` must give the loss, weights and
    gradients that plain PyTorch gives on ``reference`` (the weights ``model`` should
    have, with no gradients yet) over the same microbatches.
    """

    def check(model: RoundPipe, reference: nn.Module) -> None:
        x, y = batch(seed=7)
        num_microbatch = model.run_config.num_microbatch or len(model.pool) + 1
        loss = no_hang(model.forward_backward, (x,), label=y, loss_fn=mse_sum)
        no_hang(model.synchronize)
        expected = copy.deepcopy(reference)
        want = reference_loss_and_grads(expected, x, y, num_microbatch)
        torch.testing.assert_close(loss, want, atol=1e-5, rtol=1e-6)
        assert_weights_close(model.model, expected)
        assert_grads_close(model.model, expected)

    return check


@pytest.fixture
def faulty(wrap) -> Callable[..., tuple[RoundPipe, nn.Module, faults.FaultSwitch]]:
    """``faulty(position, config=faults.CONFIG, **options)`` -> (model, reference, switch).

    The six-layer model of ``support/faults.py``, its faulty layer at ``position``, on
    three emulated devices; closed when the test ends (see ``wrap``).
    """

    def build(position: int, config: RoundPipeRunConfig = faults.CONFIG, **options: Any):
        module, switch = faults.faulty_sequential(position)
        model, reference = wrap(module, devices="emulated:3", model_run_config=config, **options)
        return model, reference, switch

    return build

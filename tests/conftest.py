"""Fixtures shared by the tests.

The runtime tests: a hang guard, auto-closed models, the PyTorch oracle, and the
six-layer model with a faulty layer (``support/faults.py``). The emulator tests: pools
and gates driven below the runtime (``support/emulator.py``). The ``roundpipe train``
tests: a tiny BPE tokenizer and JSONL files, and the inputs and finished runs of the
command, built once per session (``support/train_cli.py``).
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from support import faults
from support.bpe_tokenizer import make_tokenizer
from support.emulator import Harness
from support.oracle import (
    assert_grads_close,
    assert_weights_close,
    batch,
    mse_sum,
    reference_loss_and_grads,
)
from support.train_cli import finish_train_runs, write_train_files
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

# -- on a GPU: the emulator's tests on CUDA workers --------------------------------------

ON_CUDA = os.environ.get("ROUNDPIPE_TESTS_ON_CUDA") == "1"
"""Set by ``bench/gpu_check.sh``'s curated slice: ``"emulated:N"`` (without emulated
options) builds N CUDA workers over the GPUs there are, ``cuda:0,...,0`` on one."""


@pytest.fixture(autouse=ON_CUDA)
def emulated_specs_on_cuda(monkeypatch) -> None:
    import roundpipe.devices
    import roundpipe.model

    build = roundpipe.devices.make_pool

    def on_cuda(spec=None, emulated_options=None):
        if isinstance(spec, str) and spec.startswith("emulated:") and emulated_options is None:
            workers, gpus = int(spec.split(":")[1]), torch.cuda.device_count()
            spec = "cuda:" + ",".join(str(i % gpus) for i in range(workers))
        return build(spec, emulated_options)

    monkeypatch.setattr(roundpipe.devices, "make_pool", on_cuda)
    monkeypatch.setattr(roundpipe.model, "make_pool", on_cuda)


# -- the runtime tests -----------------------------------------------------------------

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
        num_microbatch = model.run_config.microbatches_for(len(model.pool))
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


# -- the emulator tests ----------------------------------------------------------------


@pytest.fixture
def harness() -> Iterator[Harness]:
    """Emulated pools and host-completed gates (``support/emulator.py``), released when
    the test ends."""
    h = Harness()
    try:
        yield h
    finally:
        h.close()


# -- the roundpipe.train tests ---------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """The tiny byte-level BPE tokenizer with ChatML special tokens
    (``support/bpe_tokenizer.py``); a module may define its own ``tokenizer``."""
    return make_tokenizer()


@pytest.fixture
def write_jsonl(tmp_path) -> Callable[..., Path]:
    """``write_jsonl(lines)``: a file holding ``lines`` (dicts as JSON, strings as they are)."""

    def write(lines, name="data.jsonl"):
        path = tmp_path / name
        text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
        path.write_text(text + "\n", encoding="utf-8")
        return path

    return write


@pytest.fixture(scope="session")
def train_files(tmp_path_factory) -> dict[str, Path]:
    """The inputs of the ``roundpipe train`` tests: a tiny model, data in each format,
    eval data (``support/train_cli.py``), built once per session."""
    return write_train_files(tmp_path_factory.mktemp("train"))


@pytest.fixture(scope="session")
def train_runs(train_files) -> dict[str, Path]:
    """One finished ``roundpipe train`` run per data format (three processes, run once
    per session and shared by ``test_train_cli.py``, ``test_train_resume.py`` and
    ``test_train_errors.py``): the output directories, which no test may change."""
    return finish_train_runs(train_files)

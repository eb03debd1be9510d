"""Activation and input uploads as CUDA issues them.

- **Memory at issue time.** An upload's device memory is taken by the issuing thread
  when it issues the upload, as CUDA's caching allocator takes it, not when the upload
  runs: the emulator's issue-time capacity check covers activations too.
- **Pageable host memory blocks the issuer.** An upload reading pageable host memory
  (inputs and labels with ``pin_model="off"``, gradients a caller passes to
  ``.backward()``) is a staged copy on CUDA: issuing it blocks the issuing thread until
  the copy ran. Uploads from page-locked memory (the download pool, pinned inputs) do
  not block.

The device's activation-upload stream is held by a wait on a host-completed event, so
what the host issued is seen before anything of it has run; every wait has a timeout.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.oracle import mse_sum
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig
from roundpipe.devices import EmulatedDevicePool, EmulatedOptions

TIMEOUT_S = 10.0
WIDTH, ROWS, MICROBATCHES = 32, 64, 4  # activations 4x a layer's weights
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4
ACT_BYTES = ROWS * WIDTH * 4  # one microbatch's activation
PLAN = "1|1,1"  # forward stage 0, fused stage 1, backward stage 0


def two_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    n = ROWS * MICROBATCHES
    return torch.randn(n, WIDTH), torch.randn(n, WIDTH)


def until(condition, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class GatedCall:
    """One ``forward_backward`` on one emulated device, run on a thread while the
    device's activation-upload stream is held by a wait on a host-completed gate queued
    before it (with ``warm``, after a first, ungated call: threads started and lazy
    imports done)."""

    def __init__(
        self, pin_model: str = "auto", gate_weight_chunks=True, warm=False, **options
    ) -> None:
        options.setdefault("count_compute_memory", False)
        self.pool = EmulatedDevicePool(1, EmulatedOptions(**options))
        self.device = self.pool.devices[0]
        config = RoundPipeRunConfig(
            num_microbatch=MICROBATCHES, execute_plan=PLAN, gate_weight_chunks=gate_weight_chunks
        )
        self.pipe = RoundPipe(
            two_layers(), devices=self.pool, model_run_config=config, pin_model=pin_model
        )
        if warm:
            self._run()
            assert self.error is None
            self.pipe.synchronize()
        self.gate = self.pool.host_event()
        self.device.act_upload.wait(self.gate)
        self.thread = threading.Thread(target=self._run, daemon=True)

    error: BaseException | None = None
    loss: torch.Tensor | None = None

    def _run(self) -> None:
        x, y = batch()
        try:
            self.loss = self.pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.error = exc

    def start(self) -> GatedCall:
        self.thread.start()
        return self

    def finish(self) -> None:
        self.gate.set()
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive(), "the call did not finish once the gate opened"
        self.pipe.close()
        self.pool.close()


def test_activation_uploads_take_device_memory_when_issued():
    call = GatedCall().start()
    try:
        # Forward stage 0 issues the uploads of microbatches 0 and 1 before the host
        # waits (microbatch 2's upload waits for microbatch 0's compute): with both
        # stages' weights prefetched, that is what the device holds though nothing of
        # the uploads has run.
        issued = 2 * LAYER_BYTES + 2 * ACT_BYTES
        assert until(lambda: call.device.memory_allocated() >= issued), (
            f"{call.device.memory_allocated()} bytes taken, expected {issued}: "
            "activation uploads are not charged when issued"
        )
        time.sleep(0.05)
        assert call.device.memory_allocated() == issued  # and no more: the host waits
    finally:
        call.finish()
    assert call.error is None


def test_a_capacity_that_fits_only_if_uploads_were_charged_late_raises_when_issued():
    capacity = 2 * LAYER_BYTES + ACT_BYTES + ACT_BYTES // 2
    call = GatedCall(capacity_bytes=capacity)
    refused: list[BaseException] = []
    allocate = call.device.allocate

    def spy(host, stream):
        try:
            return allocate(host, stream)
        except torch.OutOfMemoryError as exc:
            refused.append(exc)
            raise

    call.device.allocate = spy
    call.start()
    try:
        # refused on the issuing thread while the device has run none of the uploads
        assert until(lambda: bool(refused)), "an over-capacity upload was issued anyway"
        assert not call.gate.query()
    finally:
        call.finish()
    assert isinstance(call.error, torch.OutOfMemoryError)
    message = str(call.error)
    assert "forward stage 0 (layers 0-0): upload of act 0, microbatch 1" in message
    assert "emulated device 0 is out of memory" in message


# -- pageable host memory ------------------------------------------------------------


def uploads(pin_model: str, deferred: bool = False) -> dict[str, bool]:
    """Per upload label (without the microbatch), whether it was a pageable copy."""
    x, y = batch()
    config = RoundPipeRunConfig(num_microbatch=MICROBATCHES, execute_plan=PLAN)
    with RoundPipe(
        two_layers(), devices="emulated:2", model_run_config=config, pin_model=pin_model
    ) as pipe:
        pipe.start_timeline()
        if deferred:
            pipe(x).backward(torch.ones(x.shape[0], WIDTH))
        else:
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        spans = pipe.pool.spans()
    seen: dict[str, set[bool]] = {}
    for span in spans:
        info = span.info
        if info.kind == "upload" and not info.label.startswith(("weights", "buffers")):
            seen.setdefault(info.label.rsplit(" mb", 1)[0], set()).add(info.pageable)
    assert all(len(flags) == 1 for flags in seen.values()), seen
    return {label: flags.pop() for label, flags in seen.items()}


def test_uploads_from_page_locked_memory_are_not_pageable():
    assert uploads("auto") == {"act 0": False, "label": False, "act 1": False, "grad 1": False}


def test_inputs_and_labels_in_pageable_memory_are_pageable_copies():
    # activations and gradients come from the page-locked download pool either way
    seen = uploads("off")
    assert seen == {"act 0": True, "label": True, "act 1": False, "grad 1": False}


def test_gradients_passed_to_backward_are_uploaded_as_pageable_copies():
    seen = uploads("auto", deferred=True)
    # the caller's gradient is not page-locked; the one between stages is
    assert seen == {"act 0": False, "act 1": False, "grad 2": True, "grad 1": False}


@pytest.mark.parametrize(("pin_model", "blocks"), [("off", True), ("auto", False)])
def test_issuing_a_pageable_input_upload_blocks_the_issuing_thread(pin_model, blocks):
    """With the upload stream held, the issuer gets past the first input upload (and
    issues the first forward) only if that upload does not have to be staged first.
    (Weight chunks are not gated here: a gated pageable chunk would wait for the held
    upload stream and block the prefetch thread, whatever the inputs are.)"""
    call = GatedCall(pin_model=pin_model, gate_weight_chunks=False, warm=True)
    forwards: list[str] = []
    compute = call.device.compute
    submit = compute.submit

    def spy(fn, info):
        if info.kind == "forward":
            forwards.append(info.label)
        return submit(fn, info)

    compute.submit = spy
    call.start()
    try:
        if blocks:
            time.sleep(0.3)
            assert not forwards, "a compute op was issued behind an unstaged pageable upload"
        else:
            assert until(lambda: bool(forwards)), "the issuer blocked on a page-locked upload"
    finally:
        call.finish()
    assert call.error is None
    assert forwards

"""The emulated backend's memory model is never kinder than a GPU's.

The runtime is developed and tested mostly on :class:`EmulatedDevicePool`. A schedule
that stays within memory only because the emulator is more forgiving than CUDA would
pass here and fail on real hardware, so the memory model is pinned down directly, at
the device API, below the runtime (its copy engines and buses:
``test_emulated_copies.py``):

- **Issue-time memory.** ``Device.allocate`` takes memory when the host calls it (as
  CUDA's caching allocator does), not when a stream op runs, and goes over capacity
  with ``torch.OutOfMemoryError`` naming the device, even with every stream idle or
  blocked.
- **Poisoned blocks.** Memory handed out is NaN / all bits set / True, so a read of
  memory nobody wrote gives a wrong result instead of a lucky zero.
- **record_stream.** A freed tensor kept alive on other streams stays counted until
  the work issued on those streams before the free has run.

Streams are held by waits on host-completed events (``support/emulator.py``), which
hold one stream, not its device; every wait has a timeout so that a broken model
fails instead of hanging.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.emulator import drain, floats

import roundpipe.devices.emulated.memory as emulated_memory
from roundpipe.devices import Slot

# -- issue-time memory ---------------------------------------------------------------


def test_allocate_takes_memory_when_the_host_calls_it(harness):
    capacity = 1_000_000
    pool = harness.pool(2, capacity_bytes=capacity)
    device = pool.devices[1]
    ran = threading.Event()
    release = harness.block(device.weight_upload)
    harness.submit(device.weight_upload, ran.set)

    first = device.allocate(floats(600_000), device.weight_upload)
    assert device.memory_allocated() == 600_000  # charged now, though nothing has run
    assert not ran.is_set()
    assert pool.devices[0].memory_allocated() == 0  # charged to its own device only

    with pytest.raises(torch.OutOfMemoryError, match="emulated device 1"):
        device.allocate(floats(600_000), device.act_upload)
    assert not ran.is_set()  # the check is against what the host issued, not what ran
    assert device.memory_allocated() == 600_000  # a refused allocation takes nothing
    assert device.max_memory_allocated() == 600_000

    del first
    release.set()
    drain(device.weight_upload)
    assert ran.is_set()
    assert device.memory_allocated() == 0
    device.allocate(floats(capacity), device.act_upload)  # the whole capacity is free again


def test_empty_like_over_capacity_fails_its_op_with_out_of_memory(harness):
    pool = harness.pool(1, capacity_bytes=1_000_000)
    device = pool.devices[0]
    held = device.allocate(floats(600_000), device.weight_upload)

    def op() -> None:
        device.empty_like(floats(600_000))

    harness.submit(device.act_upload, op)
    with pytest.raises(torch.OutOfMemoryError, match="emulated device 0"):
        device.act_upload.record().synchronize()
    del held
    assert device.memory_allocated() == 0


# -- poisoned memory -----------------------------------------------------------------

POISON = [
    (torch.float32, lambda t: bool(t.isnan().all())),
    (torch.float16, lambda t: bool(t.isnan().all())),
    (torch.bfloat16, lambda t: bool(t.isnan().all())),
    (torch.int64, lambda t: bool((t == -1).all())),
    (torch.int32, lambda t: bool((t == -1).all())),
    (torch.uint8, lambda t: bool((t == 255).all())),
    (torch.bool, lambda t: bool(t.all())),
]


@pytest.mark.parametrize(("dtype", "poisoned"), POISON, ids=[str(d) for d, _ in POISON])
def test_memory_is_handed_out_poisoned(harness, dtype, poisoned):
    device = harness.pool(1).devices[0]
    host = torch.zeros(64, 33, dtype=dtype).t()  # zeros, and not contiguous
    from_host = device.allocate(host, device.weight_upload)
    slot = Slot()

    def op() -> None:
        slot.value = device.empty_like(host)

    harness.submit(device.act_upload, op)
    drain(device.act_upload)
    for tensor in (from_host, slot.value):
        assert tensor.dtype == dtype and tensor.shape == host.shape
        assert tensor.is_contiguous()
        assert poisoned(tensor)


def test_poisoning_can_be_turned_off(harness, monkeypatch):
    calls = []
    real = emulated_memory.poison_value
    monkeypatch.setattr(emulated_memory, "poison_value", lambda d: calls.append(d) or real(d))
    host = torch.zeros(16)

    device = harness.pool(1).devices[0]
    device.allocate(host, device.weight_upload)
    assert len(calls) == 1  # the default poisons (the patch is in effect)

    device = harness.pool(1, poison_memory=False, capacity_bytes=1000).devices[0]
    tensor = device.allocate(host, device.weight_upload)
    assert not calls[1:]  # not poisoned; its contents are simply not guaranteed
    assert tensor.shape == host.shape and device.memory_allocated() == 64  # still counted


# -- record_stream -------------------------------------------------------------------


def test_a_freed_tensor_stays_counted_until_its_other_streams_ran(harness):
    device = harness.pool(1).devices[0]
    release = harness.block(device.compute)
    tensor = device.allocate(floats(4000), device.weight_upload)
    device.keep_alive(tensor, device.compute)
    del tensor
    # the compute work issued before the free may still read it
    assert device.memory_allocated() == 4000
    time.sleep(0.02)
    assert device.memory_allocated() == 4000
    release.set()
    drain(device.compute)
    assert device.memory_allocated() == 0


def test_a_freed_tensor_waits_for_every_stream_it_was_used_on(harness):
    device = harness.pool(1).devices[0]
    compute, download = harness.block(device.compute), harness.block(device.download)
    tensor = device.allocate(floats(4000), device.act_upload)
    device.keep_alive(tensor, device.compute)
    device.keep_alive(tensor, device.download)
    device.keep_alive(tensor, device.act_upload)  # its own stream: no wait needed
    del tensor
    compute.set()
    drain(device.compute)
    assert device.memory_allocated() == 4000  # the download stream may still read it
    download.set()
    drain(device.download)
    assert device.memory_allocated() == 0


def test_without_keep_alive_the_bytes_return_at_once(harness):
    device = harness.pool(1).devices[0]
    harness.block(device.compute)
    tensor = device.allocate(floats(4000), device.weight_upload)
    assert device.memory_allocated() == 4000
    del tensor
    assert device.memory_allocated() == 0


def test_a_tensor_freed_by_the_stream_that_used_it_returns_at_once(harness):
    """Freed inside an op of its keep_alive stream: that stream's earlier work has run."""
    device = harness.pool(1).devices[0]
    slot = Slot(device.allocate(floats(4000), device.act_upload))
    device.keep_alive(slot.value, device.compute)
    seen = Slot()

    def op() -> None:
        slot.value = None
        seen.value = device.memory_allocated()

    harness.block(device.download)  # an unrelated busy stream changes nothing
    harness.submit(device.compute, op)
    drain(device.compute)
    assert seen.value == 0


def test_memory_lives_as_long_as_any_tensor_using_it(harness):
    """Freed when the storage dies, as on CUDA: an alias or a view keeps it in use, and
    keep_alive through a view marks the block it views."""
    device = harness.pool(1).devices[0]
    tensor = device.allocate(floats(4000), device.weight_upload)
    alias, view = tensor.detach(), tensor.view(10, 100)
    assert device.is_on_device(alias) and device.is_on_device(view)
    del tensor
    assert device.memory_allocated() == 4000
    del alias
    assert device.memory_allocated() == 4000
    release = harness.block(device.compute)
    device.keep_alive(view, device.compute)
    del view
    assert device.memory_allocated() == 4000  # compute may still read it
    release.set()
    drain(device.compute)
    assert device.memory_allocated() == 0

"""Choosing the device pool: explicit specs, the environment variable, the fallback."""

from __future__ import annotations

import warnings

import pytest
import torch

import roundpipe.devices as devices
from roundpipe import EmulatedDevicePool, make_pool

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA default")


@no_cuda
def test_without_cuda_the_environment_variable_chooses_the_pool(monkeypatch):
    monkeypatch.setenv("ROUNDPIPE_DEVICES", "emulated:3")
    pool = make_pool(None)
    assert isinstance(pool, EmulatedDevicePool) and len(pool) == 3


@no_cuda
def test_without_cuda_or_variable_two_emulated_devices_with_one_notice(monkeypatch):
    monkeypatch.delenv("ROUNDPIPE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_notice_given", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first, second = make_pool(None), make_pool(None)
    assert len(first) == len(second) == 2
    assert sum("ROUNDPIPE_DEVICES" in str(w.message) for w in caught) == 1


def test_a_pool_object_is_used_as_given():
    pool = EmulatedDevicePool(2)
    assert make_pool(pool) is pool


def test_emulated_devices_have_separate_memory_from_the_host():
    pool = EmulatedDevicePool(1)
    device = pool.devices[0]
    host = torch.arange(4.0)
    on_device = device.to_device(host, device.act_upload)
    host.add_(1)
    assert torch.equal(on_device, torch.arange(4.0))
    assert device.is_on_device(on_device) and not device.is_on_device(host)
    assert device.memory_allocated() == host.numel() * host.element_size()
    del on_device
    assert device.memory_allocated() == 0


def test_an_event_orders_work_across_emulated_devices():
    pool = EmulatedDevicePool(2, devices.EmulatedOptions(jitter_s=0.005, seed=1))
    first, second = pool.devices
    log: list[str] = []
    first.compute.submit(lambda: log.append("produce"), devices.OpInfo("forward"))
    second.compute.wait(first.compute.record())
    second.compute.submit(lambda: log.append("consume"), devices.OpInfo("forward"))
    second.compute.record().synchronize()
    pool.close()
    assert log == ["produce", "consume"]

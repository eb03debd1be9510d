"""Page-locked host storages shared by several pools: registered once, unregistered by
the last holder only (never under another pool's copies), and a storage the user
replaced is given back at once instead of staying locked until close()."""

from __future__ import annotations

import torch
from torch import nn

from roundpipe import EmulatedDevicePool, RoundPipe
from roundpipe.devices.host_registrations import HostRegistrations


def test_a_storage_is_unregistered_by_its_last_holder_only():
    registrations, unregistered = HostRegistrations(), []
    storage = torch.empty(16).untyped_storage()
    address = storage.data_ptr()
    assert not registrations.hold(address)  # not registered: the caller registers it
    registrations.add(storage)  # pool A
    assert registrations.hold(address)  # pool B holds it too
    registrations.release(address, unregistered.append)  # A closes
    assert unregistered == [] and registrations.holds(address) == 1
    registrations.release(address, unregistered.append)  # B closes
    assert unregistered == [address] and registrations.holds(address) == 0
    registrations.release(address, unregistered.append)  # a stray release: nothing
    assert unregistered == [address]


class SpyPool(EmulatedDevicePool):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unpinned: list[int] = []

    def unpin(self, address: int) -> None:
        self.unpinned.append(address)


def test_a_parameter_the_user_replaces_gives_back_its_page_locked_storage():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    pool = SpyPool(2)
    with RoundPipe(model, devices=pool) as pipe:
        old = model[0].weight.untyped_storage().data_ptr()
        with torch.no_grad():
            model[0].weight.data = torch.randn(4, 4)  # replaced: the old one is unused
        x, y = torch.randn(4, 4), torch.randn(4, 2)
        pipe.forward_backward((x,), label=y, loss_fn=nn.functional.mse_loss)
        pipe.synchronize()
        assert old in pool.unpinned
    pool.close()

"""The bounded, reusable pool of page-locked host blocks downloads land in.

Below the runtime, :class:`HostBlockPool` with a fake backend: size classes a few per
cent apart, reuse once the last tensor viewing a block died and the copies recorded
on it ran, an idle cache kept under its bound, nothing left at close. Through the
runtime on the emulated backend: blocks are reused across calls, the idle cache
stays under its bound, results are bit-identical whatever the bound, nothing is held
once the model is closed.
"""

from __future__ import annotations

import gc

import pytest
import torch
from support.oracle import batch, mlp, mse_sum

from roundpipe import EmulatedOptions, RoundPipe, RoundPipeRunConfig
from roundpipe.devices import EmulatedDevicePool
from roundpipe.devices.host_blocks import PAGE, HostBlockPool, block_size


class FakeBackend:
    """Counts page-locking calls; blocks are plain host memory."""

    def __init__(self) -> None:
        self.locked: dict[int, int] = {}  # address -> size
        self.unlocked = 0

    def lock(self, size: int) -> torch.Tensor:
        memory = torch.empty(size, dtype=torch.uint8)
        self.locked[memory.data_ptr()] = size
        return memory

    def unlock(self, memory: torch.Tensor) -> None:
        del self.locked[memory.data_ptr()]
        self.unlocked += 1

    def pool(self, cache_bytes: int = 1 << 20) -> HostBlockPool:
        return HostBlockPool(cache_bytes, self.lock, self.unlock)


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class FakeStream:
    def __init__(self) -> None:
        self.events: list[FakeEvent] = []

    def record(self) -> FakeEvent:
        self.events.append(FakeEvent())
        return self.events[-1]


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 65_537, 100_000, 3 << 20, 123_456_789])
def test_size_classes_are_whole_pages_and_at_most_a_sixteenth_above_the_request(nbytes):
    size = block_size(nbytes)
    assert size >= nbytes and size % PAGE == 0
    if nbytes > 16 * PAGE:
        assert size <= nbytes * (1 + 1 / 16)
    assert block_size(size) == size  # a class is its own class


def test_a_block_is_reused_once_the_last_tensor_viewing_it_died():
    backend = FakeBackend()
    pool = backend.pool()
    first = pool.empty((1000,), torch.float32)
    view = first[10:].view(-1, 10)
    del first
    second = pool.empty((1000,), torch.float32)
    assert pool.stats().allocations == 2  # the view keeps the first block in use
    del view
    third = pool.empty((990,), torch.int32)  # same size class, other dtype and shape
    stats = pool.stats()
    assert (stats.allocations, stats.reuses) == (2, 1)
    assert third.shape == (990,) and third.dtype == torch.int32 and third.is_contiguous()
    assert third.data_ptr() != second.data_ptr()
    third.fill_(7)
    assert bool((third == 7).all())


def test_a_block_waits_for_the_copies_recorded_on_it():
    backend = FakeBackend()
    pool = backend.pool()
    stream = FakeStream()
    tensor = pool.empty((4096,), torch.uint8)
    pool.record_use(tensor[100:], stream)  # through a view, as a copy of a slice would
    del tensor
    pool.empty((4096,), torch.uint8)  # freed before, but its copy has not run
    stats = pool.stats()
    assert stats.allocations == 2 and stats.pending_bytes == 4096
    assert len(stream.events) == 1  # recorded when it was freed
    stream.events[0].done = True
    pool.empty((4096,), torch.uint8)
    assert pool.stats().reuses == 1 and pool.stats().pending_bytes == 0


def test_the_idle_cache_stays_under_its_bound_least_recently_freed_out_first():
    backend = FakeBackend()
    pool = backend.pool(cache_bytes=3 * PAGE)
    tensors = [pool.empty((PAGE,), torch.uint8) for _ in range(5)]
    addresses = [t.data_ptr() for t in tensors]
    assert pool.stats().in_use_bytes == 5 * PAGE  # blocks in use are never limited
    for i in range(5):  # freed in this order
        tensors[i] = None
    stats = pool.stats()
    assert stats.cached_bytes == 3 * PAGE and stats.in_use_bytes == 0
    assert backend.unlocked == 2
    assert set(backend.locked) == set(addresses[2:])  # the last three freed are kept
    pool.empty((PAGE,), torch.uint8)
    assert pool.stats().reuses == 1


def test_close_gives_everything_back_and_a_tensor_held_past_it_stays_valid():
    backend = FakeBackend()
    pool = backend.pool()
    held = pool.empty((3, 5), torch.float64)
    held.fill_(2.5)
    cached = pool.empty((10_000,), torch.float32)
    pending = pool.empty((10_000,), torch.float32)
    pool.record_use(pending, FakeStream())  # its event never completes by itself
    del cached, pending
    synchronized = []
    pool.close(synchronize=lambda: synchronized.append(True))
    assert synchronized  # pending copies are waited for before their blocks go back
    assert list(backend.locked) == [held.untyped_storage().data_ptr()]
    assert bool((held == 2.5).all())
    assert pool.stats().held_bytes == PAGE
    del held
    gc.collect()
    assert not backend.locked and pool.stats().held_bytes == 0
    pool.close()  # again: nothing happens


def test_emulated_download_blocks_are_page_locked():
    pool = EmulatedDevicePool(1, EmulatedOptions())
    try:
        device = pool.devices[0]
        block = pool.host_blocks.empty((8, 3), torch.float32)
        assert device.is_pinned(block) and device.is_pinned(block[2:])
        on_device = device.allocate(torch.ones(8, 3), device.download)
        on_device.fill_(1.5)
        back = device.to_host(on_device, device.download)
        assert device.is_pinned(back) and bool((back == 1.5).all())
    finally:
        pool.close()


# -- through the runtime ---------------------------------------------------------------

CALLS = 4


def train(host_cache_bytes: int | None = None, recompute_grain: str = "stage"):
    """Four calls and steps of an MLP on two emulated devices: the losses, the final
    weights, the pool's statistics after each call, and the pool."""
    options = (
        EmulatedOptions()
        if host_cache_bytes is None
        else EmulatedOptions(host_cache_bytes=host_cache_bytes)
    )
    config = RoundPipeRunConfig(
        num_microbatch=4, execute_plan="2,2|2,2,2", recompute_grain=recompute_grain
    )
    x, y = batch(size=16)
    losses, stats = [], []
    with RoundPipe(
        mlp(depth=6), devices="emulated:2", model_run_config=config, emulated_options=options
    ) as pipe:
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=0.01)
        for _ in range(CALLS):
            losses.append(pipe.forward_backward((x,), label=y, loss_fn=mse_sum))
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
            pipe.synchronize()
            gc.collect()
            stats.append(pipe.pool.host_blocks.stats())
        weights = [p.detach().clone() for p in pipe.optim_parameters()]
        pool = pipe.pool
    return losses, weights, stats, pool


def test_download_blocks_are_reused_across_calls():
    _, _, stats, _ = train(recompute_grain="layer")
    first, last = stats[0], stats[-1]
    assert first.allocations > 0
    downloads_per_call = first.allocations + first.reuses
    # later calls are served from the cache (timing may need a few more blocks)
    assert last.allocations - first.allocations <= downloads_per_call // 4
    assert last.reuses - first.reuses >= (CALLS - 1) * downloads_per_call * 3 // 4


def test_the_idle_cache_stays_under_its_bound_and_results_are_bit_identical():
    losses, weights, _, _ = train()
    bound = 2 * PAGE
    bounded_losses, bounded_weights, stats, _ = train(host_cache_bytes=bound)
    uncached_losses, uncached_weights, _, _ = train(host_cache_bytes=0)
    assert all(s.cached_bytes <= bound for s in stats)
    assert stats[-1].allocations > stats[0].allocations  # the bound made it allocate again
    for other in (bounded_losses, uncached_losses):
        assert all(torch.equal(a, b) for a, b in zip(losses, other, strict=True))
    for other in (bounded_weights, uncached_weights):
        assert all(torch.equal(a, b) for a, b in zip(weights, other, strict=True))


def test_nothing_is_held_once_the_model_is_closed():
    losses, _, stats, pool = train()
    assert stats[-1].cached_bytes > 0  # there was something to give back
    del losses
    gc.collect()
    assert pool.host_blocks.closed
    assert pool.host_blocks.stats().held_bytes == 0


# -- on a GPU (skipped without one; bench/gpu_check.sh runs them) ------------------------


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_download_blocks_are_registered_reused_and_given_back():
    from roundpipe.devices.cuda import CudaDevicePool

    pool = CudaDevicePool([0], host_cache_bytes=1 << 20)
    device = pool.devices[0]
    on_device = torch.arange(3000, dtype=torch.float32, device="cuda:0")
    try:
        for _ in range(3):
            back = device.to_host(on_device, device.download)
            assert back.is_pinned()  # a registered block: the copy is asynchronous
            device.download.record().synchronize()
            torch.testing.assert_close(back, on_device.cpu(), rtol=0, atol=0)
            again = device.allocate(back, device.act_upload)
            device.copy_in(again, back, device.act_upload)
            device.act_upload.record().synchronize()
            torch.testing.assert_close(again, on_device, rtol=0, atol=0)
            del back, again
            pool.host_blocks.stats()  # files the freed block: events on both streams
            torch.cuda.synchronize()  # which have run before the next download
        stats = pool.host_blocks.stats()
        assert stats.allocations == 1 and stats.reuses == 2
        assert stats.cached_bytes == block_size(3000 * 4)
    finally:
        pool.close()
    assert pool.host_blocks.stats().held_bytes == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_a_download_block_is_not_reused_before_its_delayed_copy_ran():
    """The copy issued as a stream op of the download stream, which is held back on the
    GPU (``torch.cuda._sleep``): its block, freed on the host at once, must not be handed
    out again until the copy ran, and its contents are the device tensor's."""
    from roundpipe.devices.base import OpInfo
    from roundpipe.devices.cuda import CudaDevicePool

    pool = CudaDevicePool([0], host_cache_bytes=1 << 20)
    device = pool.devices[0]
    download = device.streams["download"]
    on_device = torch.arange(3000, dtype=torch.float32, device="cuda:0")
    torch.cuda.synchronize()
    try:
        landed: list[torch.Tensor] = []

        def delayed_download() -> None:
            torch.cuda._sleep(100_000_000)  # ~50-100 ms of GPU clock before the copy
            landed.append(device.to_host(on_device, download))

        download.submit(delayed_download, OpInfo("download", "delayed"))
        first = landed.pop()
        address = first.data_ptr()
        del first  # freed on the host while its copy waits on the GPU
        second = pool.host_blocks.empty((3000,), torch.float32)
        assert second.data_ptr() != address, "a block was reused before its copy ran"
        done = download.record()
        done.synchronize()
        assert download.error is None
        del second
        pool.host_blocks.stats()  # files the freed blocks
        third = pool.host_blocks.empty((3000,), torch.float32)
        assert pool.host_blocks.stats().reuses >= 1  # once the copies ran, blocks return
        del third
    finally:
        pool.close()

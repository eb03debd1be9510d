"""The emulated backend's copy engines and buses are never kinder than a GPU's.

The runtime is developed and tested mostly on :class:`EmulatedDevicePool`. A schedule
that is only correct or fast because the emulator is more forgiving than CUDA would
pass here and fail on real hardware, so each copy model the emulator claims is pinned
down directly, at the device API, below the runtime (its memory model:
``test_emulated_memory.py``):

- **FIFO copy engines.** One copy at a time per direction per device, the
  earliest-issued *ready* copy first; no stream priorities, so an activation upload
  does not jump ahead of weight chunks issued before it.
- **Bandwidth.** Copies take at least their modelled time, and all devices share one
  host-memory bus.
- **Sticky errors** do not leave the copy engine held.
- **Pageable copies block the host.** Issuing a copy marked ``pageable`` returns only
  once it has run (CUDA stages pageable memory synchronously); only memory passed
  through ``pool.pin`` counts as page-locked, and a file mapping never does.

Durations are read from the spans the pool records: the emulator keeps modelled time
on the wall clock (an op ends when its modelled time has passed, never earlier), so a
span is at least its modelled duration however busy the machine is. Streams are held
by waits on host-completed events (``support/emulator.py``), which hold one stream,
not its device; every wait has a timeout so that a broken model fails instead of
hanging.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support.emulator import MB, TIMEOUT_S, drain, floats, spans

from roundpipe.core.op_kinds import StreamName
from roundpipe.devices import OpInfo, Slot

# -- FIFO copy engines ---------------------------------------------------------------

GBPS = 0.1  # slow, against scheduling noise: 1 MB takes 10 ms


def test_the_earliest_issued_ready_copy_goes_first(harness):
    pool = harness.pool(1, h2d_gbps=GBPS)
    device = pool.devices[0]
    device.h2d.record_order = True
    copying = threading.Event()
    release = harness.block(device.act_upload)
    w1 = harness.copy(device.weight_upload, 8 * MB, "w1", started=copying)  # 80 ms
    a1 = harness.copy(device.act_upload, 1 * MB, "a1")  # behind the held stream
    w2 = harness.copy(device.weight_upload, 1 * MB, "w2")
    assert copying.wait(TIMEOUT_S)
    time.sleep(0.01)
    release.set()  # a1 becomes ready while w1 is copying; w2 is ready once w1 ends
    drain(device.weight_upload, device.act_upload)
    assert device.h2d.served == [w1, a1, w2]  # a1 was issued before w2: no weight priority
    ran = spans(pool)
    assert ran["w2"][1] - ran["a1"][1] >= 0.99 * 1 * MB / (GBPS * 1e9)
    assert ran["a1"][1] - ran["w1"][1] >= 0.99 * 1 * MB / (GBPS * 1e9)


def test_an_activation_upload_does_not_jump_ahead_of_chunks_issued_before_it(harness):
    """Chunks 2-4 are not copying yet when the activation copy becomes ready, but were
    issued before it, and each is ready the moment the one before it has been copied."""
    pool = harness.pool(1, h2d_gbps=GBPS)
    device = pool.devices[0]
    device.h2d.record_order = True
    copying = threading.Event()
    release = harness.block(device.act_upload)
    # chunk 1 copies for 300 ms: the activation becomes ready while it runs, even on a
    # busy machine that wakes this thread late
    chunks = [harness.copy(device.weight_upload, 30 * MB, "w1", started=copying)]
    chunks += [harness.copy(device.weight_upload, 4 * MB, f"w{i}") for i in (2, 3, 4)]
    act = harness.copy(device.act_upload, 1 * MB, "act")
    assert copying.wait(TIMEOUT_S)
    time.sleep(0.01)
    release.set()  # act is ready about 290 ms before chunk 1 ends
    drain(device.weight_upload, device.act_upload)
    assert device.h2d.served == [*chunks, act]
    ran = spans(pool)
    assert ran["act"][1] - ran["w4"][1] >= 0.99 * 1 * MB / (GBPS * 1e9)
    # from ready to done, the activation copy waited for chunks 2-4 too
    assert ran["act"][1] - ran["act"][0] >= 0.99 * 13 * MB / (GBPS * 1e9)


def test_an_earlier_copy_that_is_not_ready_does_not_hold_back_a_later_one(harness):
    """A copy whose stream waits on an unfinished event is not ready; when the engine
    frees up it serves the later-issued ready copy instead of idling."""
    pool = harness.pool(1, h2d_gbps=GBPS)
    device = pool.devices[0]
    device.h2d.record_order = True
    copying = threading.Event()
    compute, act_gate = harness.block(device.compute), harness.block(device.act_upload)
    w0 = harness.copy(device.weight_upload, 4 * MB, "w0", started=copying)  # 40 ms
    device.weight_upload.wait(device.compute.record())
    w1 = harness.copy(device.weight_upload, 1 * MB, "w1")
    a = harness.copy(device.act_upload, 1 * MB, "a")
    assert copying.wait(TIMEOUT_S)
    act_gate.set()  # a waits for w0; w1 is issued before a but waits for the compute stream
    drain(device.act_upload)
    assert "w1" not in spans(pool)
    compute.set()
    drain(device.weight_upload)
    assert device.h2d.served == [w0, a, w1]


SLOW_BYTES, SLOW_GBPS = 2 * MB, 0.025
SLOW_COPY_S = SLOW_BYTES / (SLOW_GBPS * 1e9)  # 80 ms: long against scheduling noise,
# and small tensors, so that the real memcpy costs little CPU


def concurrent_copies(harness, pool, jobs: list[tuple[int, str]]) -> float:
    """Copy ``SLOW_BYTES`` on each (device index, stream name) at once: the ops are all
    issued behind one gate first. Seconds from the first op being ready to the last
    copy done. "download" copies device→host, the upload streams host→device."""
    release = pool.host_event()
    streams = [pool.devices[index].streams[StreamName(name)] for index, name in jobs]
    for stream in dict.fromkeys(streams):
        harness.block(stream, release)
    labels = [f"concurrent {len(pool.spans())} {i}" for i in range(len(jobs))]
    for label, stream in zip(labels, streams, strict=True):
        if stream.name != "download":
            harness.copy(stream, SLOW_BYTES, label)
            continue
        device = stream.device
        tensor = device.allocate(floats(SLOW_BYTES), stream)

        def download(device=device, stream=stream, tensor=tensor) -> None:
            device.to_host(tensor, stream)

        harness.submit(stream, download, label)
    release.set()
    drain(*streams)
    ran = spans(pool)
    assert all(label in ran for label in labels)
    return max(ran[label][1] for label in labels) - min(ran[label][0] for label in labels)


def test_an_engine_copies_one_at_a_time_and_directions_are_separate(harness):
    pool = harness.pool(1, h2d_gbps=SLOW_GBPS, d2h_gbps=SLOW_GBPS)
    both_h2d = concurrent_copies(harness, pool, [(0, "weight_upload"), (0, "act_upload")])
    assert both_h2d >= 0.99 * 2 * SLOW_COPY_S
    h2d_and_d2h = concurrent_copies(harness, pool, [(0, "weight_upload"), (0, "download")])
    assert h2d_and_d2h >= 0.99 * SLOW_COPY_S
    assert h2d_and_d2h < 0.75 * both_h2d


# -- bandwidth -----------------------------------------------------------------------


def test_a_copy_takes_at_least_its_modelled_time(harness):
    nbytes, gbps = 8 * MB, 0.5
    modelled = nbytes / (gbps * 1e9)  # 16 ms
    pool = harness.pool(1, h2d_gbps=gbps, d2h_gbps=gbps)
    device = pool.devices[0]
    on_device = device.allocate(floats(nbytes), device.download)
    back = Slot()

    def download() -> None:
        back.value = device.to_host(on_device, device.download)

    started = time.perf_counter()  # before the copies start: a busy machine may run them early
    harness.copy(device.weight_upload, nbytes, "h2d")
    harness.submit(device.download, download, "d2h")
    drain(device.weight_upload, device.download)
    assert time.perf_counter() - started >= 0.99 * modelled  # the host waited for it
    for direction, (start, end) in spans(pool).items():
        assert end - start >= 0.99 * modelled, direction
        assert end - start < 2.0, direction  # modelled, not stuck
    torch.testing.assert_close(back.value, on_device, equal_nan=True)


def test_a_copy_outside_any_op_blocks_the_calling_thread_for_its_modelled_time(harness):
    nbytes, gbps = 8 * MB, 0.5
    device = harness.pool(1, h2d_gbps=gbps).devices[0]
    started = time.perf_counter()
    device.to_device(floats(nbytes), device.act_upload)
    assert time.perf_counter() - started >= 0.99 * nbytes / (gbps * 1e9)


def test_all_devices_share_the_host_memory_bus(harness):
    jobs = [(i, "weight_upload") for i in range(4)]
    pool = harness.pool(4, h2d_gbps=SLOW_GBPS, host_gbps=SLOW_GBPS)
    shared = concurrent_copies(harness, pool, jobs)
    assert shared >= 0.99 * 4 * SLOW_COPY_S
    unshared = concurrent_copies(harness, harness.pool(4, h2d_gbps=SLOW_GBPS), jobs)
    assert unshared >= 0.99 * SLOW_COPY_S
    assert unshared < 0.6 * shared


def test_both_directions_share_the_host_memory_bus(harness):
    pool = harness.pool(2, h2d_gbps=SLOW_GBPS, d2h_gbps=SLOW_GBPS, host_gbps=SLOW_GBPS)
    shared = concurrent_copies(harness, pool, [(0, "weight_upload"), (1, "download")])
    assert shared >= 0.99 * 2 * SLOW_COPY_S


# -- sticky errors -------------------------------------------------------------------


def test_a_failed_copy_op_does_not_wedge_the_engine(harness):
    device = harness.pool(1, h2d_gbps=GBPS).devices[0]
    device.h2d.record_order = True
    src = floats(1 * MB)
    dst = device.allocate(src, device.weight_upload)

    def copy_then_fail() -> None:
        device.copy_in(dst, src, device.weight_upload)
        raise RuntimeError("boom")

    w0 = harness.copy(device.weight_upload, 1 * MB)
    failing = harness.submit(device.weight_upload, copy_then_fail)  # held once w0 ends
    harness.copy(device.weight_upload, 1 * MB)  # skipped: the stream's error is sticky
    harness.submit(device.weight_upload, lambda: None)  # held next, skipped as well
    act = harness.copy(device.act_upload, 1 * MB)
    assert device.act_upload.record().wait(TIMEOUT_S), "the act copy is stuck behind a failure"
    with pytest.raises(RuntimeError, match="boom"):
        device.weight_upload.record().synchronize()
    assert device.h2d.served == [w0, failing, act]

    pool = device.pool
    pool.clear_errors()
    again = harness.copy(device.weight_upload, 1 * MB)
    device.weight_upload.record().synchronize()
    assert device.h2d.served[-1] == again


def test_an_op_failing_before_its_copy_releases_the_engine(harness):
    """The op after a copy on the same stream is held as ready; if it fails before
    copying anything, the engine must still move on."""
    device = harness.pool(1, h2d_gbps=GBPS).devices[0]
    harness.copy(device.weight_upload, 1 * MB)

    def fail() -> None:
        raise ValueError("failed before copying")

    harness.submit(device.weight_upload, fail)
    harness.copy(device.act_upload, 1 * MB)
    assert device.act_upload.record().wait(TIMEOUT_S)
    with pytest.raises(ValueError, match="before copying"):
        device.weight_upload.record().synchronize()


# -- pageable host memory ------------------------------------------------------------


def test_issuing_a_pageable_copy_waits_until_it_ran_a_pinned_one_does_not(harness):
    device = harness.pool(1).devices[0]
    stream = device.weight_upload
    ran = []
    release = harness.block(stream)
    stream.submit(lambda: ran.append("pinned"), OpInfo("upload", "pinned"))
    assert ran == []  # returned at once, behind the blocked stream
    threading.Timer(0.05, release.set).start()
    stream.submit(lambda: ran.append("pageable"), OpInfo("upload", "pageable", pageable=True))
    assert ran == ["pinned", "pageable"]  # returned only once the stream reached and ran it


def test_only_pinned_memory_counts_as_page_locked(harness):
    pool = harness.pool(1)
    device = pool.devices[0]
    plain, pinned, off = floats(64), floats(64), floats(64)
    pool.pin(pinned, "auto")
    pool.pin(off, "off")
    assert device.is_pinned(pool.pin(pinned, "alloc"))
    assert not device.is_pinned(plain) and not device.is_pinned(off)
    mapped = floats(64)
    mapped.untyped_storage().roundpipe_mapped_file = "model.safetensors"
    pool.pin(mapped, "auto")
    assert not device.is_pinned(mapped)  # a file mapping is never locked


@pytest.mark.parametrize(("pin_model", "pageable"), [("auto", False), ("off", True)])
def test_weights_in_pageable_memory_are_uploaded_as_pageable_copies(pin_model, pageable):
    from torch import nn

    from roundpipe import RoundPipe

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    with RoundPipe(model, devices="emulated:2", pin_model=pin_model) as pipe:
        pipe.start_timeline()
        pipe.forward_backward((torch.randn(4, 8),), label=None, loss_fn=lambda y, _: y.sum())
        spans = pipe.pool.spans()
    weights = [s.info for s in spans if s.info.label.startswith("weights")]
    assert weights and all(info.pageable is pageable for info in weights)

"""One executor thread per emulated device runs the ops of all its streams.

What the executor adds to the stream semantics pinned down in
``test_emulated_memory.py`` and ``test_emulated_copies.py``:

- **Overlap.** Ops of different streams of one device run side by side in modelled
  time, as kernels and copies do on a GPU: a 50 ms kernel and a 50 ms copy take
  50 ms together, not 100.
- **Prompt wake-ups.** A stream waiting on an event of another device, or of the host,
  starts as soon as the event completes; the device is not polled.
- **Jitter** still reorders the ops of independent streams, so a missing event wait
  shows up as a wrong result.
- **Threads.** One per device, started on first use, none before; ``close`` runs what
  was queued and stops them.

Durations come from the spans the pools record (modelled, so exact whatever the load);
every wait has a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch

from roundpipe.devices import EmulatedDevicePool, EmulatedOptions, OpInfo

TIMEOUT_S = 10.0
OP_S = 0.05
COPY_BYTES, GBPS = 1_000_000, 0.02  # 1 MB at 0.02 GB/s: a 50 ms copy


EPS = 1e-9  # rounding of perf_counter sums
SHORT_S = 0.03  # not a multiple of OP_S: a device polling at some period would lag


def kernel_time(info: OpInfo) -> float:
    return {"forward": OP_S, "backward": SHORT_S}.get(info.kind, 0.0)


@pytest.fixture
def pools() -> Iterator[list[EmulatedDevicePool]]:
    made: list[EmulatedDevicePool] = []
    yield made
    for pool in made:
        pool.close()


def make(pools: list, n: int = 1, **options) -> EmulatedDevicePool:
    pool = EmulatedDevicePool(n, EmulatedOptions(**options))
    pool.start_recording()
    pools.append(pool)
    return pool


def kernel_op(device) -> None:
    """A compute op's body: kernels modelled to take ``OP_S``."""
    device.model_kernel_time(OpInfo("forward", layers=(0,)))


def done(*streams) -> None:
    for stream in streams:
        assert stream.record().wait(TIMEOUT_S), f"{stream.name} did not finish"


def window(pool: EmulatedDevicePool) -> float:
    spans = pool.spans()
    return max(s.end for s in spans) - min(s.start for s in spans)


# -- overlap -------------------------------------------------------------------------


def test_a_kernel_and_a_copy_of_one_device_overlap(pools):
    pool = make(pools, h2d_gbps=GBPS, kernel_time=kernel_time)
    device = pool.devices[0]
    src = torch.ones(COPY_BYTES // 4)
    dst = device.allocate(src, device.weight_upload)
    device.compute.submit(lambda: kernel_op(device), OpInfo("forward", "kernel"))
    device.weight_upload.submit(
        lambda: device.copy_in(dst, src, device.weight_upload), OpInfo("upload", "copy")
    )
    started = time.perf_counter()
    done(device.compute, device.weight_upload)
    assert time.perf_counter() - started >= 0.9 * OP_S  # the host waited for both
    spans = {s.info.label: s for s in pool.spans()}
    for label in ("kernel", "copy"):
        assert spans[label].end - spans[label].start >= OP_S - EPS, label
    assert window(pool) < 1.5 * OP_S  # side by side: 50 ms, not 100


def test_ops_of_one_stream_do_not_overlap(pools):
    pool = make(pools, kernel_time=kernel_time)
    device = pool.devices[0]
    for i in range(3):
        device.compute.submit(lambda: kernel_op(device), OpInfo("forward", f"k{i}"))
    done(device.compute)
    spans = sorted(pool.spans(), key=lambda s: s.start)
    assert [s.info.label for s in spans] == ["k0", "k1", "k2"]
    for before, after in zip(spans, spans[1:], strict=False):
        assert after.start >= before.end
    assert window(pool) >= 3 * OP_S - EPS


def test_a_span_records_how_long_its_closure_ran_and_the_cpu_it_used(pools):
    pool = make(pools, kernel_time=kernel_time)
    device = pool.devices[0]

    def spin() -> None:  # until this thread has used 20 ms of CPU
        start = time.thread_time()
        while time.thread_time() - start < 0.02:
            pass

    device.compute.submit(lambda: time.sleep(0.03), OpInfo("forward", "sleep"))
    device.compute.submit(spin, OpInfo("forward", "spin"))
    device.compute.submit(lambda: kernel_op(device), OpInfo("forward", "modelled"))
    done(device.compute)
    spans = {s.info.label: s for s in pool.spans()}
    assert spans["sleep"].ran >= 0.03 - EPS and spans["sleep"].cpu < 0.015
    # two clocks read at slightly different moments: equal up to ~microseconds
    assert spans["spin"].cpu >= 0.02 - EPS and spans["spin"].ran >= spans["spin"].cpu - 1e-4
    modelled = spans["modelled"]  # modelled time is not closure time
    assert modelled.end - modelled.start >= OP_S - EPS and modelled.ran < 0.5 * OP_S


def test_copies_of_one_engine_do_not_overlap_with_each_other(pools):
    pool = make(pools, h2d_gbps=GBPS)
    device = pool.devices[0]
    for stream in (device.weight_upload, device.act_upload):
        src = torch.ones(COPY_BYTES // 4)
        dst = device.allocate(src, stream)
        stream.submit(lambda d=dst, s=src, t=stream: device.copy_in(d, s, t), OpInfo("upload"))
    done(device.weight_upload, device.act_upload)
    assert window(pool) >= 2 * COPY_BYTES / (GBPS * 1e9) - EPS


def test_an_event_recorded_inside_an_op_completes_when_the_op_ends(pools):
    pool = make(pools, kernel_time=kernel_time)
    device = pool.devices[0]
    recorded = []

    def op() -> None:
        kernel_op(device)
        recorded.append(device.compute.record())

    device.compute.submit(op, OpInfo("forward", "kernel"))
    done(device.compute)
    (event,) = recorded
    assert event.query()
    (span,) = pool.spans()
    assert event.time == span.end


# -- wake-ups ------------------------------------------------------------------------


def test_a_wait_on_another_devices_event_wakes_the_device_at_once(pools):
    pool = make(pools, 2, kernel_time=kernel_time)
    producer, consumer = pool.devices
    short = OpInfo("backward", layers=(0,))
    producer.compute.submit(lambda: producer.model_kernel_time(short), OpInfo("other", "produce"))
    consumer.compute.wait(producer.compute.record())
    ran = []
    consumer.compute.submit(lambda: ran.append(time.perf_counter()), OpInfo("other", "consume"))
    done(consumer.compute)
    spans = {s.info.label: s for s in pool.spans()}
    assert spans["produce"].end - spans["produce"].start >= SHORT_S - EPS
    assert spans["consume"].start >= spans["produce"].end  # ordered
    assert ran[0] - spans["produce"].end < 0.015  # and woken, not polled


def test_a_wait_on_a_host_event_holds_one_stream_not_the_device(pools):
    pool = make(pools)
    device = pool.devices[0]
    gate = pool.host_event()
    ran: list[str] = []
    device.act_upload.wait(gate)
    device.act_upload.submit(lambda: ran.append("held"), OpInfo("upload"))
    device.compute.submit(lambda: ran.append("free"), OpInfo("forward"))
    done(device.compute)
    assert ran == ["free"]
    set_at = time.perf_counter()
    gate.set()
    done(device.act_upload)
    assert ran == ["free", "held"]
    (held,) = [s for s in pool.spans() if s.stream == "act_upload"]
    assert held.start >= set_at and held.end - set_at < 0.02


# -- jitter --------------------------------------------------------------------------


def run_order(jitter_s: float, seed: int) -> list[int]:
    """The order in which ops alternately issued on two independent streams ran."""
    pool = EmulatedDevicePool(1, EmulatedOptions(jitter_s=jitter_s, seed=seed))
    device = pool.devices[0]
    order: list[int] = []
    for i in range(40):
        stream = device.compute if i % 2 else device.download
        stream.submit(lambda i=i: order.append(i), OpInfo("other"))
    done(device.compute, device.download)
    pool.close()
    return order


def test_jitter_reorders_independent_streams():
    assert run_order(0.0, seed=0) == list(range(40))  # without jitter: issue order
    orders = [run_order(0.002, seed) for seed in range(3)]
    for order in orders:
        assert sorted(order) == list(range(40))
        assert order != list(range(40))
    # each stream still runs its own ops in order
    for order in orders:
        for parity in (0, 1):
            mine = [i for i in order if i % 2 == parity]
            assert mine == sorted(mine)


# -- threads -------------------------------------------------------------------------


def executor_threads(before: set[threading.Thread]) -> list[str]:
    return sorted(
        t.name for t in threading.enumerate() if t not in before and t.name.startswith("roundpipe")
    )


def test_one_thread_per_device_started_on_first_use(pools):
    before = set(threading.enumerate())
    pool = make(pools, 3)
    assert executor_threads(before) == []  # none before first use
    first = pool.devices[0]
    for stream in first.streams.values():
        stream.submit(lambda: None, OpInfo("other"))
    done(*first.streams.values())
    assert executor_threads(before) == ["roundpipe-emu0"]  # one for all four streams
    for device in pool.devices[1:]:
        device.compute.submit(lambda: None, OpInfo("other"))
    done(*(device.compute for device in pool.devices))
    assert executor_threads(before) == ["roundpipe-emu0", "roundpipe-emu1", "roundpipe-emu2"]


def test_close_runs_what_was_queued_then_stops_the_threads():
    before = set(threading.enumerate())
    pool = EmulatedDevicePool(2, EmulatedOptions(kernel_time=kernel_time))
    ran: list[int] = []
    for i, device in enumerate(pool.devices):
        device.compute.submit(lambda d=device: kernel_op(d), OpInfo("forward"))
        device.download.submit(lambda i=i: ran.append(i), OpInfo("download"))
    pool.close()
    assert sorted(ran) == [0, 1]
    assert executor_threads(before) == []

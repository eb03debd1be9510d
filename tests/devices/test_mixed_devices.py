"""Emulated devices that differ: per-device speeds, device classes, class-dependent masks.

A device at speed ``s`` takes its modelled kernel time divided by ``s``; devices of one
speed are one device class, and, as GPU models do on CUDA, devices of different classes
draw different dropout masks from the same seed, while the default class (speed 1.0)
draws exactly as after ``torch.manual_seed`` (docs/design.md, "Emulated backend").
"""

from __future__ import annotations

import statistics

import pytest
import torch
from support.oracle import mse_sum
from torch import nn

from roundpipe import EmulatedDevicePool, EmulatedOptions, RoundPipe, RoundPipeRunConfig
from roundpipe.devices import OpInfo, Slot, device_count, make_pool

SEED = 20240607


@pytest.mark.parametrize(
    ("speeds", "message"),
    [
        ((1.0, 0.5), "2 speeds for 3 devices"),
        (0.0, "finite and above 0"),
        ((1.0, -0.5, 1.0), "finite and above 0"),
        ((1.0, float("inf"), 1.0), "finite and above 0"),
        (float("nan"), "finite and above 0"),
    ],
)
def test_bad_speeds_are_refused_when_the_pool_is_made(speeds, message):
    with pytest.raises(ValueError, match=message):
        EmulatedDevicePool(3, EmulatedOptions(speeds=speeds))


def test_one_speed_applies_to_every_device_and_a_tuple_to_each(harness):
    harness.pools += [EmulatedDevicePool(2, EmulatedOptions(speeds=0.5))]
    harness.pools += [EmulatedDevicePool(3, EmulatedOptions(speeds=(1.0, 2.0, 0.25)))]
    assert [device.speed for device in harness.pools[0]] == [0.5, 0.5]
    assert [device.speed for device in harness.pools[1]] == [1.0, 2.0, 0.25]


def test_device_classes_name_each_speed_and_mixed_says_whether_they_differ(harness):
    harness.pools += [
        EmulatedDevicePool(2),
        EmulatedDevicePool(2, EmulatedOptions(speeds=0.5)),
        EmulatedDevicePool(3, EmulatedOptions(speeds=(1.0, 0.5, 2.0))),
    ]
    equal, slow, mixed = harness.pools
    assert equal.device_classes() == ["emulated", "emulated"] and not equal.mixed
    assert slow.device_classes() == ["emulated@0.5x"] * 2 and not slow.mixed
    assert mixed.device_classes() == ["emulated", "emulated@0.5x", "emulated@2x"]
    assert mixed.mixed
    assert mixed.devices[1].device_class == "emulated@0.5x"


@pytest.mark.parametrize(
    ("spec", "speeds"),
    [
        ("emulated:4@1,1,0.5,0.5", [1.0, 1.0, 0.5, 0.5]),
        ("emulated:4@0.5", [0.5] * 4),
        ("emulated:2", [1.0, 1.0]),
    ],
)
def test_a_spec_string_gives_the_speeds(harness, spec, speeds):
    pool = make_pool(spec)
    assert isinstance(pool, EmulatedDevicePool)
    harness.pools.append(pool)
    assert [device.speed for device in pool] == speeds
    assert device_count(spec) == len(speeds)


def test_spec_speeds_are_merged_into_the_given_options(harness):
    pool = make_pool("emulated:2@1,0.5", EmulatedOptions(capacity_bytes=1 << 20))
    assert isinstance(pool, EmulatedDevicePool)
    harness.pools.append(pool)
    assert pool.options.speeds == (1.0, 0.5)
    assert pool.options.capacity_bytes == 1 << 20


def test_speeds_given_twice_are_refused():
    with pytest.raises(ValueError, match="give them once"):
        make_pool("emulated:2@0.5", EmulatedOptions(speeds=(1.0, 0.25)))


@pytest.mark.parametrize(
    "spec", ["emulated:4@", "emulated:4@a", "emulated:4@1,2", "emulated:4@0", "emulated:4@-1"]
)
def test_bad_speed_specs_name_the_accepted_forms(spec):
    for parse in (make_pool, device_count):
        with pytest.raises(ValueError, match=r"emulated:N@S1,\.\.\.,SN"):
            parse(spec)


def test_an_unknown_spec_names_the_speed_forms():
    with pytest.raises(ValueError, match=r"unknown device spec 'tpu'.*emulated:N@S"):
        make_pool("tpu")


def per_layer_time(info: OpInfo) -> float:
    """30 ms of modelled kernel time per layer, whatever the kind of work."""
    return 0.03 * len(info.layers)


def test_a_device_at_half_speed_takes_twice_the_modelled_kernel_time():
    """Four equal layers, one layer per forward and backward stage but the fused one, on
    devices at speeds 1 and 0.5: the one-layer compute ops (forward, recompute,
    backward; 30 ms modelled each at speed 1) last about twice as long on device 1."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    config = RoundPipeRunConfig(num_microbatch=1, execute_plan="1,1|2,1,1")
    options = EmulatedOptions(kernel_time=per_layer_time)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with RoundPipe(
        model, devices="emulated:2@1,0.5", model_run_config=config, emulated_options=options
    ) as pipe:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)  # warm-up: first runs are slow
        pipe.synchronize()
        pipe.pool.start_recording()
        for _ in range(2):
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.synchronize()
        spans = pipe.pool.spans()
    durations: dict[int, list[float]] = {0: [], 1: []}
    for span in spans:
        if span.info.kind in ("forward", "recompute", "backward") and len(span.info.layers) == 1:
            durations[span.device].append(span.end - span.start)
    assert durations[0] and durations[1]
    ratio = statistics.median(durations[1]) / statistics.median(durations[0])
    assert 1.6 <= ratio <= 2.6, (ratio, durations)


def dropout_masks(device, seed: int, layer: nn.Module) -> torch.Tensor:
    """What ``layer`` (a dropout) makes of ones in a compute op of ``device``, drawing
    from ``seed`` under the device's random scope."""
    result = Slot()

    def run() -> None:
        with device.random_scope(seed, layer):
            result.value = layer(torch.ones(256))

    device.compute.submit(run, OpInfo("forward"))
    device.compute.record().synchronize()
    return result.take()


def test_devices_of_one_class_draw_the_same_masks_and_other_classes_other_ones(harness):
    pool = make_pool("emulated:5@1,1,0.5,0.5,0.25")
    harness.pools.append(pool)
    layer = nn.Dropout(0.5)
    masks = [dropout_masks(device, SEED, layer) for device in pool]
    assert torch.equal(masks[0], masks[1])
    assert torch.equal(masks[2], masks[3])
    assert not torch.equal(masks[0], masks[2])
    assert not torch.equal(masks[2], masks[4])
    assert not torch.equal(masks[0], masks[4])


def test_the_default_class_draws_as_after_torch_manual_seed(harness):
    pool = make_pool("emulated:2@1,0.5")
    harness.pools.append(pool)
    layer = nn.Dropout(0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        want = nn.Dropout(0.5)(torch.ones(256))
    # twice: the first run learns that the layer draws, the second draws under the lock
    for _ in range(2):
        assert torch.equal(dropout_masks(pool.devices[0], SEED, layer), want)
    assert not torch.equal(dropout_masks(pool.devices[1], SEED, layer), want)


def test_masks_of_a_class_depend_on_the_seed_reproducibly(harness):
    pool = make_pool("emulated:1@0.5")
    harness.pools.append(pool)
    layer = nn.Dropout(0.5)
    first, again = (dropout_masks(pool.devices[0], SEED, layer) for _ in range(2))
    other_seed = dropout_masks(pool.devices[0], SEED + 1, layer)
    assert torch.equal(first, again)
    assert not torch.equal(first, other_seed)


def test_cuda_workers_on_one_gpu_share_its_memory_and_class(monkeypatch):
    """``cuda:0,0,1``: the two workers of GPU 0 plan with half its usable memory each,
    the worker of GPU 1 with all of its; each reports its GPU's model as its class. (On
    the CPU: the device objects are made without streams, the properties faked.)"""
    from types import SimpleNamespace

    from roundpipe.devices.cuda import CudaDevice, CudaDevicePool

    cards = {0: SimpleNamespace(total_memory=24 << 30, name="NVIDIA GeForce RTX 4090"),
             1: SimpleNamespace(total_memory=24 << 30, name="NVIDIA GeForce RTX 3090")}  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: cards[index])
    pool = object.__new__(CudaDevicePool)
    pool.headroom_bytes, pool.headroom_fraction = 1 << 30, 0.08
    devices = []
    for position, index in enumerate((0, 0, 1)):
        device = object.__new__(CudaDevice)
        device.pool, device.index, device.position = pool, index, position
        devices.append(device)
    pool.devices = devices
    usable = int((24 << 30) * 0.92) - (1 << 30)
    assert [d.memory_capacity() for d in devices] == [usable // 2, usable // 2, usable]
    assert pool.device_classes() == [cards[0].name, cards[0].name, cards[1].name]
    assert pool.mixed

"""The profiler keeps layer timings per device class: each class's costs are its own
measurements, and the reference class's (device 0's) times its measured relative time
on the layers it has not run; a class's speed is measured, never assumed."""

from __future__ import annotations

import pytest
import torch
from support.oracle import mse_sum
from torch import nn

from roundpipe import EmulatedOptions, RoundPipe
from roundpipe.runtime.profiler import LayerProfiler

MS = 1e-3


def fed(profiler: LayerProfiler, records) -> LayerProfiler:
    """``profiler`` after ``records``: (kind, layers, milliseconds, device)."""
    for kind, layers, ms, device in records:
        profiler.record(kind, layers, ms * MS, device)
    return profiler


def two_classes() -> LayerProfiler:
    """Four layers on devices of classes a, a, b, b: class a measured everywhere; class
    b's forward on layers 0-2 at 2x, 2.5x and 2x a's, its backward on layer 0 at 2.5x."""
    profiler = LayerProfiler(
        [10, 20, 30, 40], [40, 80, 120, 160], device_classes=["a", "a", "b", "b"]
    )
    a = [("forward", [i], i + 1.0, 0) for i in range(4)]
    a += [("backward", [i], 2.0 * (i + 1), 1) for i in range(4)]
    b = [("forward", [i], ms, 2) for i, ms in enumerate([2.0, 5.0, 6.0])]
    return fed(profiler, [*a, *b, ("backward", [0], 5.0, 3)])


def times_ms(costs) -> list[float]:
    """Forward, backward and recompute times of each layer, one flat list, in ms."""
    return [t / MS for t in (*costs.forward, *costs.backward, *costs.recompute)]


def test_a_measurement_is_kept_for_the_class_of_the_device_that_ran_it():
    profiler = LayerProfiler([10, 10], [40, 40], device_classes=["fast", "slow"])
    fed(profiler, [("forward", [0], 1.0, 0), ("forward", [1], 3.0, 1)])
    costs = profiler.class_costs()
    assert costs["fast"].forward[0] == pytest.approx(1 * MS)
    assert costs["slow"].forward[1] == pytest.approx(3 * MS)


def test_each_class_series_is_smoothed_on_its_own():
    profiler = LayerProfiler([10], [40], smoothing=0.5, device_classes=["a", "b"])
    fed(profiler, [("forward", [0], 1.0, 0), ("forward", [0], 4.0, 1), ("forward", [0], 3.0, 0)])
    costs = profiler.class_costs()
    assert costs["a"].forward[0] == pytest.approx(2 * MS)  # 1, then halfway to 3
    assert costs["b"].forward[0] == pytest.approx(4 * MS)


def test_one_class_gives_the_cost_model_of_a_profiler_without_classes():
    records = [
        ("forward", [0], 1.0, 0),
        ("forward", [1], 2.0, 1),
        ("recompute", [1], 2.5, 1),
        ("backward", [0, 1], 6.0, 0),
        ("forward", [0], 1.5, 1),
    ]
    plain = fed(LayerProfiler([10, 20], [40, 80]), records)
    one_class = fed(LayerProfiler([10, 20], [40, 80], device_classes=["x", "x"]), records)
    for profiler in (plain, one_class):
        profiler.record_boundary(1000)
        profiler.record_transfer("h2d", 2**20, 2**20 / 4e9)
    assert one_class.cost_model(4096) == plain.cost_model(4096)
    assert not one_class.cost_model(4096).mixed
    assert one_class.relative_speeds() == {"x": 1.0}
    assert plain.relative_speeds() == {}


def test_a_class_keeps_its_measurements_and_scales_the_reference_elsewhere():
    model = two_classes().cost_model(None)
    a = [1, 2, 3, 4] + [2, 4, 6, 8] + [1, 2, 3, 4]  # forward, backward, recompute (forward)
    # b over a: forwards 2, 2.5 and 2 times a's: median 2
    b = [2, 5, 6, 8] + [5, 8, 12, 16] + [2, 4, 6, 8]
    assert model.mixed and len(model.device_layers) == 4
    for device, expected in enumerate([a, a, b, b]):
        assert times_ms(model.layers_on(device)) == pytest.approx(expected)
    assert times_ms(model.layers) == pytest.approx(a)


def test_relative_speeds_are_measured_against_the_fastest_class():
    assert two_classes().relative_speeds() == pytest.approx({"a": 1.0, "b": 0.5})
    faster_b = LayerProfiler([10], [40], device_classes=["a", "b"])
    fed(faster_b, [("forward", [0], 4.0, 0), ("forward", [0], 1.0, 1)])
    assert faster_b.relative_speeds() == pytest.approx({"a": 0.25, "b": 1.0})


def test_a_class_is_at_full_speed_until_measured_beside_the_reference():
    profiler = LayerProfiler([10, 20], [40, 80], device_classes=["a", "b"])
    assert profiler.relative_speeds() == {"a": 1.0, "b": 1.0}
    fed(profiler, [("forward", [0], 1.0, 0), ("forward", [1], 9.0, 1)])  # layers of two sizes
    assert profiler.relative_speeds() == {"a": 1.0, "b": 1.0}


def test_layers_of_one_size_stand_in_for_each_other_when_no_layer_ran_on_both():
    # A mixed pool places every call's jobs alike: a never runs layers 2-3, b never 0-1.
    profiler = LayerProfiler([10] * 4, [40] * 4, device_classes=["a", "b"])
    fed(profiler, [("forward", [0], 1.0, 0), ("forward", [1], 1.0, 0)])
    fed(profiler, [("forward", [2], 3.0, 1), ("forward", [3], 3.0, 1)])
    assert profiler.relative_speeds() == pytest.approx({"a": 1.0, "b": 1 / 3})
    # the reference's time on a layer only b ran: b's over b's relative time
    assert profiler.costs().forward == pytest.approx((1 * MS,) * 4)
    assert profiler.class_costs()["b"].forward == pytest.approx((3 * MS,) * 4)


def test_backwards_give_the_relative_time_where_no_forward_is_shared():
    profiler = LayerProfiler([10, 20], [40, 80], device_classes=["a", "b"])
    fed(profiler, [("forward", [0], 1.0, 0), ("forward", [1], 9.0, 1)])  # layers of two sizes
    fed(profiler, [("backward", [0], 2.0, 0), ("backward", [0], 6.0, 1)])
    assert profiler.relative_speeds() == pytest.approx({"a": 1.0, "b": 1 / 3})


def test_a_stage_measurement_is_split_by_the_forward_shares_on_its_class():
    profiler = LayerProfiler([10, 10], [40, 40], device_classes=["a", "b"])
    fed(profiler, [("forward", [0], 1.0, 1), ("forward", [1], 3.0, 1), ("backward", [0, 1], 8, 1)])
    assert profiler.class_costs()["b"].backward == pytest.approx((2 * MS, 6 * MS))


def test_a_device_outside_the_pool_is_refused_naming_the_positions():
    profiler = LayerProfiler([10], [40], device_classes=["a", "b"])
    with pytest.raises(ValueError, match=r"device 2.*position in pool.devices \(0 to"):
        profiler.record("forward", [0], 1.0, device=2)


def test_a_real_mixed_pool_measures_the_slow_class_at_its_speed():
    def kernel_time(info) -> float:  # 4 ms per layer and compute op, at speed 1
        computes = info.kind in ("forward", "recompute", "backward")
        return 4 * MS * max(1, len(info.layers)) if computes else 0.0

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    options = EmulatedOptions(kernel_time=kernel_time)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with RoundPipe(model, devices="emulated:2@1,0.5", emulated_options=options) as pipe:
        for _ in range(8):  # the first call's one-time work decays out of the smoothed times
            pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
            pipe.synchronize()
        speeds = pipe.profiler.relative_speeds()
        model_costs = pipe.profiler.cost_model(None)
    assert set(speeds) == {"emulated", "emulated@0.5x"}
    assert speeds["emulated"] == 1.0
    assert 0.35 <= speeds["emulated@0.5x"] <= 0.7, speeds
    slow, fast = model_costs.layers_on(1), model_costs.layers_on(0)
    assert sum(slow.forward) > 1.4 * sum(fast.forward)


@pytest.mark.parametrize("seed", range(20))
def test_the_forward_times_a_measurement_is_split_by_are_the_class_costs(seed):
    """``ClassProfiles.forward_times`` (what splits every multi-layer measurement, found
    for the op's layers only) equals the class's forward costs at those layers, whatever
    each class has measured: its own layers, the reference's, or neither."""
    import random

    rng = random.Random(seed)
    classes = ["a", "a", "b", "c"][: rng.randint(1, 4)]
    sizes = [rng.choice([10, 20, 30]) for _ in range(8)]
    profiler = LayerProfiler(sizes, [4 * s for s in sizes], device_classes=classes)
    for _ in range(rng.randint(0, 20)):
        kind = rng.choice(["forward", "recompute", "backward"])
        profiler.record(
            kind, [rng.randrange(8)], rng.uniform(0.5, 3) * MS, rng.randrange(len(classes))
        )
    profiles = profiler._profiles
    estimates = [profiler._estimate(i) for i in range(8)]
    reference = profiles.reference_times(estimates)
    for name in profiles.classes:
        layers = sorted(rng.sample(range(8), rng.randint(2, 5)))
        want = profiles.class_times(name, reference)["forward"]
        assert profiles.forward_times(name, layers, profiler._estimate) == [want[i] for i in layers]

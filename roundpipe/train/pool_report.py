"""What ``roundpipe train`` says about its device pool: the devices it found, counted per
device class at the start, and on a mixed pool the speeds measured and the plan used at
the end (docs/cli.md, "--devices")."""

from __future__ import annotations

from collections import Counter
from typing import Any

GIB = 2**30


def where_it_runs(devices: str | None, world: int) -> str:
    """The ``--devices`` spec, or under ``torchrun`` the processes that each run one."""
    return f"{devices}" if world <= 1 else f"{world} processes ({devices} each)"


def pool_line(pool: Any) -> str:
    """``devices: 2 x NVIDIA GeForce RTX 4090 (23.6 GiB), 1 x emulated (unlimited)``: the
    devices of ``pool`` counted per class and memory plans may use, in pool order."""
    counted = Counter((device.device_class, device.memory_capacity()) for device in pool)
    found = [
        f"{count} x {name} ({_memory(capacity)})" for (name, capacity), count in counted.items()
    ]
    return "devices: " + ", ".join(found)


def pool_speeds(pipe: Any, config: Any) -> list[str]:
    """On a pool of several device classes, the line ``pool speeds measured: emulated
    1.00, emulated@0.5x 0.51; plan 3|3,3``: each class's speed relative to the fastest,
    measured while training, and the plan of a call with the run config ``config`` (the
    last step's); nothing on a pool of one class or before any step (``config`` None)."""
    if config is None or not pipe.pool.mixed:
        return []
    speeds = pipe.profiler.relative_speeds()
    measured = ", ".join(
        f"{name} {speeds[name]:.2f}" if name in speeds else f"{name} not measured"
        for name in dict.fromkeys(pipe.pool.device_classes())
    )
    plan = pipe.runtime.plan_for(config, count_call=False)
    return [f"pool speeds measured: {measured}; plan {plan}"]


def _memory(capacity: int | None) -> str:
    if capacity is None:
        return "unlimited"
    return f"{capacity / GIB:.1f} GiB" if capacity >= GIB else f"{capacity / 2**20:.0f} MiB"

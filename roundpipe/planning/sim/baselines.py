"""Weight-bound pipeline baselines: GPipe, 1F1B, interleaved 1F1B and looped BFS.

Every stage bound to one GPU, with Megatron-PP's full recomputation or stashed
activations, one flush per iteration: what RoundPipe is compared with
(docs/design.md#baselines).
"""

from __future__ import annotations

from collections.abc import Sequence

from ...core.plan import stage_ranges
from ...core.timeline import Timeline
from . import engine
from .costs import CostModel
from .engine import COMPUTE, Dep, Op
from .result import SimResult, bubbles, busy_time, compute_makespan, peak_memory

BASELINES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs")
_CHUNKED = frozenset({"interleaved-1f1b", "looped-bfs"})

Action = tuple[str, int, int]
"""``("F" | "B", stage, microbatch)``."""


def simulate_baseline(
    name: str,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    stage_sizes: Sequence[int] | None = None,
    chunks: int = 2,
    recompute: bool = True,
) -> SimResult:
    """Simulate one iteration of baseline ``name`` (one of :data:`BASELINES`).

    ``stage_sizes`` gives layers per stage (``num_devices x chunks`` stages for the
    interleaved schedules); by default the layers are balanced over the stages.
    """
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    virtual = chunks if name in _CHUNKED else 1
    num_stages = num_devices * virtual
    layers = costs.layers
    if stage_sizes is None:
        stage_sizes = balanced_partition(stage_costs_per_layer(costs, recompute), num_stages)
    _check_stages(stage_sizes, num_stages, layers.num_layers, name)
    ranges = stage_ranges(stage_sizes)
    orders = [
        device_order(name, rank, num_devices, num_microbatches, virtual)
        for rank in range(num_devices)
    ]
    ops, memory = _build_ops(orders, ranges, costs, num_devices, recompute)
    timings = engine.run(ops)
    spans = engine.spans(ops, timings)
    makespan = compute_makespan(spans)
    resident = _resident_bytes(ranges, costs, num_devices)
    memory += [(device, 0.0, makespan, size) for device, size in enumerate(resident)]
    exposed = sum(timings[op.key].exposed_transfer for op in ops if op.stream == COMPUTE)
    result_bubbles = bubbles(spans, num_devices, makespan)
    return SimResult(
        schedule=name,
        num_devices=num_devices,
        makespan=makespan,
        busy=busy_time(spans),
        bubbles=result_bubbles,
        exposed_comm=exposed,
        peak_memory=tuple(peak_memory(_resolve(memory, timings), num_devices)),
        timeline=Timeline(spans),
        iteration_time=makespan,
        steady_bubble_ratio=result_bubbles.total,
        detail=f"stages {','.join(map(str, stage_sizes))}"
        + ("" if recompute else ", no recompute"),
    )


def stage_costs_per_layer(costs: CostModel, recompute: bool = True) -> list[float]:
    """A layer's total time in a baseline: forward, backward and (not for the head) recompute."""
    layers = costs.layers
    last = layers.num_layers - 1
    return [
        layers.forward[i]
        + layers.backward[i]
        + (layers.recompute[i] if recompute and i < last else 0)
        for i in range(layers.num_layers)
    ]


def balanced_partition(weights: Sequence[float], num_stages: int) -> list[int]:
    """Cut ``weights`` into ``num_stages`` contiguous non-empty parts minimising the largest sum."""
    if not 1 <= num_stages <= len(weights):
        raise ValueError(f"cannot cut {len(weights)} layers into {num_stages} non-empty stages")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    candidates = sorted(
        {prefix[j] - prefix[i] for i in range(len(weights)) for j in range(i + 1, len(prefix))}
    )
    lo, hi = 0, len(candidates) - 1
    while lo < hi:  # smallest cap whose greedy packing needs at most num_stages parts
        mid = (lo + hi) // 2
        if len(_greedy(weights, candidates[mid])) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    sizes = _greedy(weights, candidates[lo])
    while len(sizes) < num_stages:  # splitting a part never raises the largest sum
        widest = max(range(len(sizes)), key=lambda i: sizes[i])
        sizes[widest : widest + 1] = [sizes[widest] - 1, 1]
    return sizes


def device_order(
    name: str, rank: int, num_devices: int, num_microbatches: int, chunks: int
) -> list[Action]:
    """The order in which device ``rank`` runs its forward and backward actions."""
    p, m = num_devices, num_microbatches
    if name == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if name == "1f1b":
        return _one_f_one_b(
            min(p - rank - 1, m), m, lambda k: ("F", rank, k), lambda k: ("B", rank, k)
        )
    if name == "looped-bfs":
        stages = [c * p + rank for c in range(chunks)]
        return [("F", s, i) for s in stages for i in range(m)] + [
            ("B", s, i) for s in reversed(stages) for i in range(m)
        ]
    if m % p:
        raise ValueError(
            f"interleaved 1F1B needs the microbatch count ({m}) to be a multiple of the "
            f"device count ({p})"
        )

    def virtual(k: int, backward: bool) -> Action:
        chunk = (k // p) % chunks
        stage = (chunks - 1 - chunk if backward else chunk) * p + rank
        return ("B" if backward else "F", stage, (k // (p * chunks)) * p + k % p)

    warmup = min((p - rank - 1) * 2 + (chunks - 1) * p, m * chunks)
    return _one_f_one_b(warmup, m * chunks, lambda k: virtual(k, False), lambda k: virtual(k, True))


def _one_f_one_b(warmup, total, forward, backward) -> list[Action]:
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    return order + [backward(k) for k in range(total - warmup, total)]


def _build_ops(orders, ranges, costs: CostModel, num_devices: int, recompute: bool):
    layers = costs.layers
    last_stage, head = len(ranges) - 1, layers.num_layers - 1
    ops: list[Op] = []
    memory: list[tuple[int, object, object, int]] = []
    for rank, order in enumerate(orders):
        for kind, stage, mb in order:
            span = ranges[stage]
            body = range(span.start, min(span.stop, head))  # the head is never recomputed
            key = (kind, stage, mb)
            if kind == "F":
                deps = (Dep(("F", stage - 1, mb), costs.comm),) if stage else ()
                ops.append(
                    Op(
                        key,
                        rank,
                        COMPUTE,
                        "forward",
                        f"F{stage} mb{mb}",
                        layers.stage_forward(span),
                        deps,
                    )
                )
                kept = (
                    layers.boundary_bytes
                    if recompute and body
                    else layers.stage_activation_bytes(span)
                )
                memory.append((rank, key, ("B", stage, mb), kept))
                continue
            incoming = (
                Dep(("B", stage + 1, mb), costs.comm)
                if stage < last_stage
                else Dep(("F", stage, mb))
            )
            label = f"B{stage} mb{mb}"
            if recompute and body:
                ops.append(
                    Op(
                        ("R", stage, mb),
                        rank,
                        COMPUTE,
                        "recompute",
                        label,
                        layers.stage_recompute(body),
                        (incoming,),
                    )
                )
                memory.append((rank, ("R", stage, mb), key, layers.stage_activation_bytes(body)))
                incoming = Dep(("R", stage, mb))
            ops.append(
                Op(
                    key,
                    rank,
                    COMPUTE,
                    "backward",
                    label,
                    layers.stage_backward(span),
                    (incoming,),
                )
            )
    return ops, memory


def _resident_bytes(ranges, costs: CostModel, num_devices: int) -> list[int]:
    """Bound weights, gradients and device optimizer state of each device's stages."""
    per_weight_byte = 1 + costs.grad_bytes_ratio + costs.device_optimizer_ratio
    resident = [0] * num_devices
    for stage, span in enumerate(ranges):
        resident[stage % num_devices] += int(costs.layers.stage_param_bytes(span) * per_weight_byte)
    return resident


def _resolve(memory, timings) -> list[tuple[int, float, float, int]]:
    resolved = []
    for device, start, end, size in memory:
        if isinstance(start, float):
            resolved.append((device, start, end, size))
        else:
            resolved.append((device, timings[start].start, timings[end].end, size))
    return resolved


def _check_stages(sizes: Sequence[int], num_stages: int, num_layers: int, name: str) -> None:
    if len(sizes) != num_stages or any(s < 1 for s in sizes) or sum(sizes) != num_layers:
        raise ValueError(
            f"{name} needs {num_stages} non-empty stages covering all {num_layers} layers, "
            f"got stage sizes {list(sizes)}"
        )


def _greedy(weights: Sequence[float], cap: float) -> list[int]:
    sizes: list[int] = []
    total = 0.0
    for w in weights:
        if sizes and total + w <= cap + 1e-12:
            sizes[-1] += 1
            total += w
        else:
            sizes.append(1)
            total = w
    return sizes

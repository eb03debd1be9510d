"""Does the runtime achieve the schedule the simulator predicts?

Emulated devices get a timing model: every compute op sleeps for modelled kernel
time (per-layer forward / recompute / backward seconds), and weight uploads and
gradient downloads take ``bytes / bandwidth`` on a per-device link. The layers are
tiny in real compute, so modelled time dominates. RoundPipe then runs real
pipelined training iterations (one ``forward_backward`` of M microbatches plus an
asynchronous ``step``), and the measured steady-state time per iteration is
compared with ``roundpipe.planning.sim.steady_iteration_time`` for the same plan, costs,
bandwidth and weight bytes (activation transfers: comm = 0).

    .venv/bin/python bench/sim_vs_runtime.py --devices 4 8
    .venv/bin/python bench/sim_vs_runtime.py --json     # one JSON object per line
    .venv/bin/python bench/sim_vs_runtime.py --devices 4 --plan "3,3,3|4,3,3,3" --spans
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch import nn

from roundpipe import EmulatedOptions, Plan, RoundPipe, RoundPipeRunConfig
from roundpipe.devices import OpInfo, SpanRecord
from roundpipe.planning.partition import auto_plan
from roundpipe.planning.sim import CostModel, LayerCosts, steady_iteration_time


def build_model(layers: int, width: int) -> nn.Sequential:
    """``layers`` tiny linear layers and a linear head: negligible real compute."""
    torch.manual_seed(0)
    body = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)]
    return nn.Sequential(*body, nn.Linear(width, 1))


def layer_costs(model: nn.Sequential, args: argparse.Namespace) -> LayerCosts:
    """Per-layer modelled seconds (the head is the last layer) and real weight bytes."""
    body = len(model) - 1
    forward = [args.fwd_ms / 1e3] * body + [args.head_fwd_ms / 1e3]
    backward = [args.bwd_ms / 1e3] * body + [args.head_bwd_ms / 1e3]
    sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model]
    return LayerCosts(tuple(forward), tuple(backward), tuple(sizes))


def kernel_time(costs: LayerCosts) -> Callable[[OpInfo], float]:
    """Modelled seconds of a compute op: its kind's cost summed over its layers."""
    per_kind = {
        "forward": costs.forward,
        "recompute": costs.recompute,
        "backward": costs.backward,
        "fused": tuple(f + b for f, b in zip(costs.forward, costs.backward, strict=True)),
    }

    def seconds(info: OpInfo) -> float:
        table = per_kind.get(info.kind)
        return sum(table[i] for i in info.layers) if table else 0.0

    return seconds


def cost_model(costs: LayerCosts, args: argparse.Namespace) -> CostModel:
    return CostModel(
        costs, comm=0.0, h2d_bandwidth=args.h2d_gbps * 1e9, d2h_bandwidth=args.d2h_gbps * 1e9
    )


def measure(
    model: nn.Sequential, plan: Plan, devices: int, costs: LayerCosts, args: argparse.Namespace
) -> tuple[float, list[SpanRecord]]:
    """Median seconds between successive iterations' losses, and the ops of the timed ones."""
    micro = args.microbatches or devices + 1
    options = EmulatedOptions(
        h2d_gbps=args.h2d_gbps, d2h_gbps=args.d2h_gbps, kernel_time=kernel_time(costs)
    )
    config = RoundPipeRunConfig(num_microbatch=micro, execute_plan=plan)
    with RoundPipe(
        model, devices=f"emulated:{devices}", model_run_config=config, emulated_options=options
    ) as pipe:
        seconds = timed_iterations(pipe, micro, args.warmup, args)
        return seconds, pipe.pool.spans()


def timed_iterations(pipe: RoundPipe, micro: int, warmup: int, args: argparse.Namespace) -> float:
    """Median seconds between successive iterations' losses after ``warmup`` untimed
    ones (``forward_backward`` of ``micro`` microbatches of ``args.rows`` rows, then an
    asynchronous SGD ``step``); the timed iterations' ops are recorded."""
    x = torch.randn(micro * args.rows, args.width)
    y = torch.randn(micro * args.rows, 1)
    optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=1e-4)

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad()

    stamps = []
    for iteration in range(warmup + args.iterations + 1):
        if iteration == warmup:
            pipe.pool.start_recording()
        pipe.forward_backward((x,), label=y, loss_fn=nn.functional.mse_loss)
        stamps.append(time.perf_counter())
        pipe.step(update)
    pipe.synchronize()
    gaps = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1 :], strict=False)]
    return statistics.median(gaps)


def span_report(spans: list[SpanRecord], model_time: Callable[[OpInfo], float]) -> None:
    """Per op kind: how long ops took against their modelled time."""
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    for span in spans:
        total = totals[(span.stream, span.info.kind)]
        modelled = model_time(span.info) if span.stream == "compute" else 0.0
        total[0] += 1
        total[1] += span.end - span.start
        total[2] += modelled
    print(f"    {'stream/kind':24} {'ops':>5} {'mean ms':>8} {'model ms':>8}")
    for (stream, kind), (count, took, modelled) in sorted(totals.items()):
        print(
            f"    {stream + '/' + kind:24} {count:5d} {took / count * 1e3:8.2f} "
            f"{modelled / count * 1e3:8.2f}"
        )
    compute = defaultdict(float)
    for span in spans:
        if span.stream == "compute":
            compute[span.device] += span.end - span.start
    window = max(s.end for s in spans) - min(s.start for s in spans)
    busy = ", ".join(f"{compute[d] / window:.0%}" for d in sorted(compute))
    print(f"    compute busy per device over the recorded window: {busy}")


def work_bound(plan: Plan, costs: LayerCosts, devices: int, micro: int) -> float:
    """Modelled compute seconds per iteration spread evenly over the devices: no schedule
    can be faster (recompute for every layer outside the fused stage)."""
    fused = plan.fused_range()
    per_microbatch = sum(costs.forward) + sum(costs.backward)
    per_microbatch += sum(costs.recompute[i] for i in range(costs.num_layers) if i not in fused)
    return per_microbatch * micro / devices


def compare(devices: int, args: argparse.Namespace) -> None:
    """Measure and simulate one device count; print one result line (and spans if asked)."""
    model = build_model(args.layers, args.width)
    costs = layer_costs(model, args)
    micro = args.microbatches or devices + 1
    model_costs = cost_model(costs, args)
    plan = Plan.parse(args.plan) if args.plan else auto_plan(model_costs, devices, micro)
    plan.validate(costs.num_layers)
    simulated = steady_iteration_time(plan, model_costs, devices, micro, round_size=micro)
    measured, spans = measure(model, plan, devices, costs, args)
    bound = work_bound(plan, costs, devices, micro)
    if args.json:
        result = {
            "devices": devices,
            "measured_ms": round(measured * 1e3, 2),
            "simulated_ms": round(simulated * 1e3, 2),
            "ratio": round(measured / simulated, 3),
            "microbatches": micro,
            "plan": str(plan),
            "bound_ms": round(bound * 1e3, 2),
        }
        print(json.dumps(result), flush=True)
        return
    print(
        f"{devices:7d} {micro:5d}  {str(plan):24} {bound * 1e3:7.1f}"
        f" {measured * 1e3:9.1f} {simulated * 1e3:9.1f} {measured / simulated:6.2f}"
    )
    if args.spans:
        span_report(spans, kernel_time(costs))


def add_model_arguments(
    parser: argparse.ArgumentParser, layers: int, head_ms: tuple[float, float]
) -> None:
    """The timing model's options (what :func:`layer_costs`, :func:`cost_model` and
    :func:`timed_iterations` read), with ``layers`` before a head of ``head_ms``
    (forward, backward) by default."""
    parser.add_argument("--layers", type=int, default=layers, help="layers before the head")
    parser.add_argument("--width", type=int, default=256, help="layer width (sets weight bytes)")
    parser.add_argument("--rows", type=int, default=4, help="samples per microbatch")
    parser.add_argument("--fwd-ms", type=float, default=4.0, help="modelled forward per layer")
    parser.add_argument("--bwd-ms", type=float, default=8.0, help="modelled backward per layer")
    parser.add_argument("--head-fwd-ms", type=float, default=head_ms[0])
    parser.add_argument("--head-bwd-ms", type=float, default=head_ms[1])
    parser.add_argument("--h2d-gbps", type=float, default=0.1, help="modelled PCIe, per device")
    parser.add_argument("--d2h-gbps", type=float, default=0.1)
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations")
    parser.add_argument("--iterations", type=int, default=6, help="timed iterations")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--microbatches", type=int, help="per iteration (default: devices + 1)")
    add_model_arguments(parser, layers=12, head_ms=(8.0, 16.0))
    parser.add_argument("--plan", help='pin a plan, e.g. "3,3,3|4,3,3,3" (default: auto_plan)')
    parser.add_argument("--spans", action="store_true", help="per op kind: measured vs modelled")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per configuration (devices, measured_ms, simulated_ms, "
        "ratio = measured / simulated, microbatches, plan, bound_ms)",
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if not args.json:
        print(
            f"{'devices':>7} {'mbs':>5}  {'plan':24} {'bound':>7} {'meas ms':>9} {'sim ms':>9}"
            f" {'ratio':>6}"
        )
    for devices in args.devices:
        compare(devices, args)


if __name__ == "__main__":
    main()

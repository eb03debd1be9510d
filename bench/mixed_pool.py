"""Mixed pools: does a pool of unequal devices train at the sum of its devices' speeds?

Emulated devices with a timing model (as ``bench/sim_vs_runtime.py``: modelled kernel
seconds per layer, weight uploads and gradient downloads at a modelled bandwidth), some
at half speed (``EmulatedOptions(speeds=...)``: a device at speed s takes the modelled
time / s). For each pool, one run each, side by side:

- **mixed plan**: ``auto_plan`` on the costs of each device (``CostModel.with_speeds``),
  which sizes every stage for the device that runs it;
- **equal plan**: the plan ``auto_plan`` gives for equal devices, on the same mixed pool
  (what the pool got before it knew its devices differ);
- **each device's own speed**: a pool of N devices all of one kind, per device; the sum
  over the mixed pool's devices is what the pool is worth;
- **alone**: one device of each kind by itself (no recompute: its plan fuses everything),
  summed over the devices, for the record;
- **runtime's plan**: no plan pinned: the runtime profiles each device class while it
  trains and re-plans (after ``--auto-warmup`` iterations);
- **simulated**: ``steady_iteration_time`` of the mixed plan on the same costs, and the
  same two ratios as the simulator predicts them (on 8 emulated devices the equal pools'
  many small jobs are bound by the 2-core host, not by the modelled devices).

    .venv/bin/python bench/mixed_pool.py                   # 2 fast + 2 half, 4 + 4
    .venv/bin/python bench/mixed_pool.py --json
    .venv/bin/python bench/mixed_pool.py --pools 1,1,0.5,0.5 --quick
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from sim_vs_runtime import (
    add_model_arguments,
    build_model,
    cost_model,
    kernel_time,
    layer_costs,
    timed_iterations,
)
from torch import nn

from roundpipe import EmulatedOptions, Plan, RoundPipe, RoundPipeRunConfig
from roundpipe.planning.partition import auto_plan
from roundpipe.planning.sim import CostModel, steady_iteration_time


def iteration_seconds(
    model: nn.Sequential,
    plan: Plan | None,
    speeds: tuple[float, ...],
    microbatches: int,
    model_time,
    args: argparse.Namespace,
    warmup: int | None = None,
) -> tuple[float, Plan]:
    """Median seconds between successive iterations' losses on an emulated pool of
    ``speeds``, ``plan`` pinned (None: the runtime's automatic plan, from what its
    profiler measures per device class), asynchronous steps; and the plan at the end."""
    warmup = args.warmup if warmup is None else warmup
    options = EmulatedOptions(
        h2d_gbps=args.h2d_gbps, d2h_gbps=args.d2h_gbps, kernel_time=model_time, speeds=speeds
    )
    config = RoundPipeRunConfig(num_microbatch=microbatches, execute_plan=plan)
    with RoundPipe(
        model,
        devices=f"emulated:{len(speeds)}",
        model_run_config=config,
        emulated_options=options,
    ) as pipe:
        return timed_iterations(pipe, microbatches, warmup, args), pipe.plan


def compare(speeds: tuple[float, ...], args: argparse.Namespace) -> dict:
    n, m = len(speeds), len(speeds) + 1
    model = build_model(args.layers, args.width)
    costs = layer_costs(model, args)
    base: CostModel = cost_model(costs, args)
    mixed_costs = base.with_speeds(speeds)
    model_time = kernel_time(costs)
    started = time.perf_counter()
    mixed_plan = auto_plan(mixed_costs, n, m, round_size=m)
    planning_s = time.perf_counter() - started
    equal_plan = auto_plan(base, n, m, round_size=m)

    def run(plan: Plan, pool: tuple[float, ...], microbatches: int = m) -> float:
        return iteration_seconds(model, plan, pool, microbatches, model_time, args)[0]

    mixed = run(mixed_plan, speeds)
    equal = run(equal_plan, speeds)
    auto, auto_plan_used = iteration_seconds(
        model, None, speeds, m, model_time, args, warmup=args.auto_warmup
    )
    # a device's own speed: its share of an equal pool of its kind (iterations/s per device)
    kinds = sorted(set(speeds))
    own_ms = {s: run(equal_plan, (s,) * n) for s in kinds}
    worth = sum(1 / (n * own_ms[s]) for s in speeds)
    alone_plan = auto_plan(base, 1, 2, round_size=2)
    alone_ms = {s: run(alone_plan, (s,), 2) for s in kinds}  # 2 microbatches, not m
    alone = sum(2 / (m * alone_ms[s]) for s in speeds)
    simulated = steady_iteration_time(mixed_plan, mixed_costs, n, m, round_size=m)
    simulated_own = {
        s: steady_iteration_time(equal_plan, base.with_speeds([s] * n), n, m, round_size=m)
        for s in kinds
    }
    simulated_worth = sum(1 / (n * simulated_own[s]) for s in speeds)
    return {
        "speeds": list(speeds),
        "microbatches": m,
        "mixed_plan": str(mixed_plan),
        "equal_plan": str(equal_plan),
        "mixed_ms": round(mixed * 1e3, 1),
        "equal_plan_ms": round(equal * 1e3, 1),
        "speedup_over_equal_plan": round(equal / mixed, 3),
        "fraction_of_devices_worth": round((1 / mixed) / worth, 3),
        "fraction_of_devices_alone": round((1 / mixed) / alone, 3),
        "equal_pool_ms": {str(s): round(t * 1e3, 1) for s, t in own_ms.items()},
        "alone_ms_per_2_microbatches": {str(s): round(t * 1e3, 1) for s, t in alone_ms.items()},
        "runtime_plan": str(auto_plan_used),
        "runtime_plan_ms": round(auto * 1e3, 1),
        "simulated_ms": round(simulated * 1e3, 1),
        "measured_over_simulated": round(mixed / simulated, 3),
        "simulated_fraction_of_devices_worth": round((1 / simulated) / simulated_worth, 3),
        "simulated_speedup_over_equal_plan": round(
            steady_iteration_time(equal_plan, mixed_costs, n, m, round_size=m) / simulated, 3
        ),
        "planning_s": round(planning_s, 2),
    }


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--pools",
        nargs="+",
        default=["1,1,0.5,0.5", "1,1,1,1,0.5,0.5,0.5,0.5"],
        help="device speeds of each pool, comma-separated",
    )
    add_model_arguments(parser, layers=24, head_ms=(4.0, 8.0))
    parser.add_argument(
        "--auto-warmup", type=int, default=12, help="untimed iterations of the runtime's own plan"
    )
    parser.add_argument("--quick", action="store_true", help="8 layers, 1 + 3 iterations")
    parser.add_argument("--json", action="store_true", help="one JSON object per pool")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.warmup, args.iterations, args.auto_warmup = 8, 1, 3, 4
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    for pool in args.pools:
        speeds = tuple(float(s) for s in pool.split(","))
        result = compare(speeds, args)
        if args.json:
            print(json.dumps(result), flush=True)
            continue
        print(
            f"speeds {pool}: mixed plan {result['mixed_plan']} {result['mixed_ms']} ms/iter, "
            f"equal plan {result['equal_plan']} {result['equal_plan_ms']} ms "
            f"({result['speedup_over_equal_plan']}x); "
            f"{result['fraction_of_devices_worth']:.1%} of the devices' worth "
            f"(runtime's own plan {result['runtime_plan']} {result['runtime_plan_ms']} ms) "
            f"({result['fraction_of_devices_alone']:.1%} of each alone); simulated "
            f"{result['simulated_ms']} ms (measured/simulated "
            f"{result['measured_over_simulated']})",
            flush=True,
        )


if __name__ == "__main__":
    main()

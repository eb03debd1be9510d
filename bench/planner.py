"""How fast the automatic planner is, and how good its plans are.

Speed: ``auto_plan`` on deep uniform models (a 32B-like layer: 20 ms forward per
microbatch, 975 MB of weights over a 25 GB/s link) for 64 and 200 layers on 8
devices. Quality, on the randomised profiles of ``roundpipe.planning.sim.profiles`` (fixed
seeds): the automatic plan's steady-state iteration time against the paper's greedy
rule and against the best plan with equal-size stages (every fused size f and stage
size k, searched exhaustively with the lower bounds of ``roundpipe.planning.sim.bounds``: a
plan whose cheap or job-level bound is above the incumbent cannot win), its isolated
iteration (one iteration from idle) against the compute lower bound: the first layer's
weight upload and first forward, then the least total compute over N (the plan with
the largest fused stage: the least recompute); and its steady-state iteration, where
iterations overlap as in training, against its own compute over N, recompute included
(``steady_vs_work``). The paper's four simulator cases
(``roundpipe.predict.paper_cases``): the automatic plan for each objective (steady
state, asynchronous steps; makespan, one isolated iteration with a synchronous step)
against the paper's rule and the best equal-size plan on that objective, and the
steady objective's plan on the makespan (what was used before the objective existed).

    .venv/bin/python bench/planner.py [--profiles 20] [--json] [--skip-speed]
    .venv/bin/python bench/planner.py --paper [--unrefined] [--json]

Times are wall-clock seconds; on a shared machine compare runs made together.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from roundpipe.planning.partition import (
    auto_plan,
    equal_size_plans,
    paper_greedy_plan,
    predict_iteration_time,
)
from roundpipe.planning.sim.bounds import PlanBounds
from roundpipe.planning.sim.costs import CostModel, LayerCosts
from roundpipe.planning.sim.profiles import random_profile
from roundpipe.planning.sim.roundpipe_schedule import simulate_roundpipe
from roundpipe.predict.paper_cases import paper_cases

SPEED_CASES = ((28, 4, 8), (64, 8, 8), (64, 8, 16), (200, 8, 16))


def deep_model(layers: int) -> CostModel:
    forward, weights = 0.02, int(975e6)
    costs = LayerCosts(
        (0.0, *[forward] * layers, 0.03),
        (0.0, *[2 * forward] * layers, 0.06),
        (int(1.5e9), *[weights] * layers, int(1.5e9)),
    )
    return CostModel(costs, comm=0.0017, h2d_bandwidth=25e9, d2h_bandwidth=25e9)


def speed(as_json: bool) -> None:
    for objective in ("steady", "makespan"):
        for layers, devices, micro in SPEED_CASES:
            costs = deep_model(layers)
            start = time.perf_counter()
            plan = auto_plan(costs, devices, micro, round_size=micro, objective=objective)
            seconds = time.perf_counter() - start
            row = {"layers": layers, "devices": devices, "microbatches": micro}
            row |= {"objective": objective, "plan_s": round(seconds, 3), "plan": str(plan)}
            print(json.dumps(row) if as_json else _speed_line(row), flush=True)


def _speed_line(row: dict) -> str:
    return (
        f"auto_plan {row['layers']:3d} layers, {row['devices']} devices, "
        f"{row['microbatches']:2d} microbatches, {row['objective']:8s}: {row['plan_s']:6.2f} s"
    )


def paper(as_json: bool, refine: bool) -> None:
    """Per case and objective: auto / the paper's rule, auto / the best equal-size plan,
    for the objective's own plan and (makespan) for the steady objective's plan; the
    runtime's plans (refined) or, with ``refine`` off, the predictor's."""
    for case in paper_cases():
        micro, budgets = case.num_microbatches, list(case.budgets)
        plans = {}
        for objective in ("steady", "makespan"):
            start = time.perf_counter()
            plans[objective] = auto_plan(
                case.costs,
                case.num_devices,
                micro,
                budgets,
                round_size=micro,
                refine=refine,
                objective=objective,
            )
            seconds = time.perf_counter() - start
            papers = case.paper_plans(objective)
            row = {"case": case.name, "objective": objective, "plan_s": round(seconds, 3)}
            for label, plan in (("auto", plans[objective]), ("steady_plan", plans["steady"])):
                for name, reference in papers.items():
                    ratio = case.time(plan, objective) / case.time(reference, objective)
                    row[f"{label}_vs_{name}"] = round(ratio, 4)
            row |= {"plan": str(plans[objective]), "equal_size_plan": str(papers["equal-size"])}
            print(json.dumps(row) if as_json else row, flush=True)


def best_equal_size(costs, devices: int, micro: int, incumbent: float) -> float:
    bounds = PlanBounds(costs, devices, micro, round_size=micro)
    best = incumbent
    for plan in sorted(equal_size_plans(costs.layers.num_layers), key=bounds.of):
        if bounds.of(plan) >= best:
            break
        if bounds.tight(plan) < best:
            best = min(best, predict_iteration_time(plan, costs, devices, micro, round_size=micro))
    return best


def isolated_bound(costs: CostModel, devices: int, micro: int) -> float:
    layers = costs.layers
    bounds = PlanBounds(costs, devices, micro, round_size=micro)
    least_work = bounds.least_work
    first = costs.upload_time(layers.param_bytes[0]) + layers.forward[0]
    return first + least_work - layers.forward[0] / devices


def quality(count: int, as_json: bool) -> None:
    rows = []
    for seed in range(count):
        profile = random_profile(seed)
        costs, devices, micro = profile.costs, profile.num_devices, profile.num_microbatches

        def steady(plan, costs=costs, devices=devices, micro=micro) -> float:
            return predict_iteration_time(plan, costs, devices, micro, round_size=micro)

        start = time.perf_counter()
        plan = auto_plan(costs, devices, micro, round_size=micro)
        seconds = time.perf_counter() - start
        auto = steady(plan)
        greedy = steady(paper_greedy_plan(costs.layers))
        equal = best_equal_size(costs, devices, micro, auto * (1 + 1e-9))
        alone = simulate_roundpipe(plan, costs, devices, micro, round_size=micro).makespan
        work = PlanBounds(costs, devices, micro, round_size=micro).work(plan.backward[0])
        row = {
            "seed": seed,
            "layers": costs.layers.num_layers - 1,
            "devices": devices,
            "microbatches": micro,
            "plan_s": round(seconds, 3),
            "auto_vs_greedy": round(auto / greedy, 4),
            "auto_vs_equal_size": round(auto / equal, 4),
            "isolated_vs_bound": round(alone / isolated_bound(costs, devices, micro), 4),
            "steady_vs_work": round(auto / work, 4),
        }
        rows.append(row)
        print(json.dumps(row) if as_json else row, flush=True)
    if not as_json:
        keys = ("plan_s", "auto_vs_greedy", "auto_vs_equal_size", "isolated_vs_bound")
        for key in (*keys, "steady_vs_work"):
            values = [row[key] for row in rows]
            print(
                f"{key:20s} median {statistics.median(values):.3f}  max {max(values):.3f}  "
                f"min {min(values):.3f}"
            )
        losses = sum(row["auto_vs_equal_size"] > 1 + 1e-6 for row in rows)
        print(f"profiles where an equal-size plan beats the automatic one: {losses}/{len(rows)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profiles", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--paper", action="store_true", help="only the paper's four cases")
    parser.add_argument("--unrefined", action="store_true", help="--paper: the predictor's plans")
    args = parser.parse_args()
    if args.paper:
        paper(args.json, refine=not args.unrefined)
        return
    if not args.skip_speed:
        speed(args.json)
    quality(args.profiles, args.json)


if __name__ == "__main__":
    main()

"""The planner's fast paths must not change what it optimises.

``sim.walk`` computes iteration ends job by job instead of replaying the op graph: it
must give the engine's floats exactly (or say it cannot). ``sim.job_bound`` relaxes the
schedule to three times per job: each iteration must end no later than simulated. The
search prunes with bounds: it must pick what scoring every candidate would pick.
"""

from __future__ import annotations

import random

import pytest

from roundpipe.core.plan import Plan
from roundpipe.planning.partition import predict_iteration_time
from roundpipe.planning.rules import equal_size
from roundpipe.planning.search import Search
from roundpipe.planning.sim.bounds import PlanBounds
from roundpipe.planning.sim.costs import CostModel, LayerCosts
from roundpipe.planning.sim.job_bound import JobCosts, relaxed_iteration_ends
from roundpipe.planning.sim.profiles import random_profile
from roundpipe.planning.sim.roundpipe_schedule import steady_iteration_time
from roundpipe.planning.sim.rounds import Config, Simulation
from roundpipe.planning.sim.walk import Undecided, isolated_time, iteration_ends

ITERATIONS = 6


def _split(rng: random.Random, total: int, size: int) -> tuple[int, ...]:
    sizes = []
    while total:
        sizes.append(min(total, rng.randint(max(1, size - 2), size + 2)))
        total -= sizes[-1]
    return tuple(sizes)


def _case(seed: int):
    """Random costs (zero-time layers, weightless layers, chunked uploads, a host
    optimizer, activation hops), a random plan, pool, round size and optimizer mode."""
    rng = random.Random(seed)
    n, devices, micro = rng.randint(2, 30), rng.choice([1, 2, 3, 4, 8]), rng.randint(1, 14)
    forward = [0.0 if rng.random() < 0.1 else rng.uniform(0.5, 2) for _ in range(n)]
    costs = CostModel(
        LayerCosts(
            tuple(forward),
            tuple(f * rng.uniform(1.5, 3) for f in forward),
            tuple(rng.choice([0, rng.randint(1, 10**8)]) for _ in range(n)),
        ),
        comm=rng.choice([0.0, rng.uniform(0, 0.5)]),
        h2d_bandwidth=rng.choice([1e7, 1e8, 1e9]),
        d2h_bandwidth=rng.choice([1e7, 1e9]),
        optimizer_time=rng.choice([0.0, rng.uniform(0, 50)]),
        weight_chunk_bytes=rng.choice([None, 10**7, 256 * 2**20]),
    )
    fused, size = rng.randint(1, n), rng.randint(1, 6)
    if fused == n:
        plan = Plan((), (n,))
    else:
        plan = Plan(_split(rng, n - fused, size), (fused, *_split(rng, n - fused, size)))
    round_size = rng.randint(1, micro) if rng.random() < 0.5 else micro
    return plan, costs, devices, micro, round_size, rng.random() < 0.7


def _graph_ends(plan, costs, devices, micro, round_size, is_async) -> list[float]:
    config = Config(plan, costs, devices, round_size, is_async, record=False)
    return Simulation(config).iteration_ends(micro, ITERATIONS + 1)[:-1]


@pytest.mark.parametrize("seed", range(120))
def test_the_walk_gives_the_engines_iteration_ends_exactly(seed: int) -> None:
    plan, costs, devices, micro, round_size, is_async = _case(seed)
    expected = _graph_ends(plan, costs, devices, micro, round_size, is_async)
    try:
        walked = iteration_ends(
            plan, costs, devices, micro, ITERATIONS, round_size=round_size, is_async=is_async
        )
    except Undecided:
        return  # the caller replays the graph
    assert walked == expected  # the same floats, not just close


@pytest.mark.parametrize("seed", range(12))
def test_the_walk_decides_the_planners_cases(seed: int) -> None:
    """Rounds of all the call's microbatches (three or more) on the randomised profiles:
    the walk must not fall back to the graph there, or the planner is slow again."""
    profile = random_profile(seed, layers=(8, 30))
    costs, devices, micro = profile.costs, profile.num_devices, profile.num_microbatches
    n = costs.layers.num_layers
    rng = random.Random(seed)
    for _ in range(3):
        size = rng.randint(1, max(1, n // devices))
        plan = equal_size(n, rng.randint(1, size + 1), size)
        walked = iteration_ends(
            plan, costs, devices, micro, ITERATIONS, round_size=micro, is_async=True
        )
        assert walked == _graph_ends(plan, costs, devices, micro, micro, True)


@pytest.mark.parametrize("seed", range(120))
def test_the_job_level_relaxation_never_ends_an_iteration_after_the_simulation(
    seed: int,
) -> None:
    plan, costs, devices, micro, round_size, is_async = _case(seed)
    simulated = _graph_ends(plan, costs, devices, micro, round_size, is_async)
    relaxed = relaxed_iteration_ends(
        plan,
        JobCosts(costs),
        devices,
        micro,
        ITERATIONS,
        round_size=round_size,
        is_async=is_async,
    )
    for low, high in zip(relaxed, simulated, strict=True):
        assert low <= high * (1 + 1e-12) + 1e-12


@pytest.mark.parametrize("seed", range(120))
def test_the_isolated_walk_and_its_bounds_against_the_graph(seed: int) -> None:
    """One iteration from idle with a synchronous step (the makespan objective): the
    walk gives the end of the graph's last op exactly, and no isolated bound is above."""
    plan, costs, devices, micro, round_size, _ = _case(seed)
    config = Config(plan, costs, devices, round_size, False, record=False)
    expected = Simulation(config).isolated_end(micro)
    bounds = PlanBounds(costs, devices, micro, round_size=round_size, isolated=True)
    assert bounds.tight(plan) <= expected * (1 + 1e-12) + 1e-12
    assert bounds.fused_floor(plan.backward[0]) <= expected * (1 + 1e-12) + 1e-12
    try:
        walked = isolated_time(plan, costs, devices, micro, round_size=round_size)
    except Undecided:
        return
    assert walked == expected


def test_the_steady_state_counts_the_prefetch_of_the_iteration_after_the_last_one() -> None:
    """A 7-iteration run's last iteration has nothing prefetching behind it, so it ends
    early; the estimate must match a long run, whose iterations all do."""
    profile = random_profile(0)
    costs, devices, micro = profile.costs, profile.num_devices, profile.num_microbatches
    plan = Plan.parse("1,1,1,1,1,1,1|67,1,1,1,1,1,1,1")
    config = Config(plan, costs, devices, micro, True, record=False)
    ends = Simulation(config).iteration_ends(micro, 30)
    long_run = (ends[-2] - ends[-14]) / 12
    short = Simulation(config).iteration_ends(micro, 7)
    assert (short[-1] - short[2]) / 4 < 0.99 * long_run  # the old estimate: too fast
    steady = steady_iteration_time(plan, costs, devices, micro, round_size=micro)
    assert steady == pytest.approx(long_run, rel=1e-3)


@pytest.mark.parametrize("seed", range(6))
def test_the_pruned_search_picks_what_scoring_every_candidate_would(seed: int) -> None:
    profile = random_profile(seed, layers=(10, 24))
    costs, devices, micro = profile.costs, profile.num_devices, profile.num_microbatches
    search = Search(costs, devices, micro, None, micro)
    candidates = list(search.candidates())
    candidates += list(search.equal_size_plans(None))
    chosen = search.best(candidates)
    assert search.simulated < len(candidates) / 4  # the bounds spare most simulations

    def score(plan: Plan) -> float:
        time = predict_iteration_time(plan, costs, devices, micro, round_size=micro)
        return time * (1 + 1e-9 * (len(plan.forward) + len(plan.backward)))

    assert score(chosen) == pytest.approx(min(map(score, candidates)), rel=1e-12)

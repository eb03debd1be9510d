"""A forward-only pass through RoundPipe: the price of a call without a loss or autograd,
such as a reference model's log-probabilities in preference tuning.

Each round runs as the runtime runs ``model(x)`` under ``no_grad``: ``lower_unfused``'s
forward jobs (the plan's forward stages, then its fused stage as one more forward stage),
every stage's weights uploaded once per round, each microbatch's forward compute, its
activations handed on through the host; no backward, recompute, gradient download or
optimizer step. The op graph is :class:`~.rounds.Simulation`'s with
``Config.forward_only`` (the scoring walk knows training rounds only).
"""

from __future__ import annotations

from ...core.plan import Plan
from .costs import CostModel
from .roundpipe_schedule import MEASURED_ITERATIONS, WARMUP_ITERATIONS
from .rounds import Config, Simulation


def forward_pass_time(
    plan: Plan,
    costs: CostModel,
    num_devices: int,
    num_microbatches: int,
    *,
    round_size: int | None = None,
) -> float:
    """Seconds per forward-only pass over ``num_microbatches`` once passes follow each
    other (rounds of ``round_size``, default ``num_devices``): the mean pass after the
    warm-up ones, in a run where one more pass follows, as the training steady state is
    measured (:func:`~.roundpipe_schedule.steady_mean`)."""
    plan.validate(costs.layers.num_layers)
    config = Config(
        plan, costs, num_devices, round_size or num_devices, True, record=False, forward_only=True
    )
    warm, measured = WARMUP_ITERATIONS, MEASURED_ITERATIONS
    ends = Simulation(config).iteration_ends(num_microbatches, warm + measured + 1)
    return (ends[warm + measured - 1] - ends[warm - 1]) / measured

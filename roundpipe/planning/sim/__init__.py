"""Discrete-event simulation of RoundPipe and of weight-bound pipeline baselines.

Pure logic: no threads, no devices, no torch. RoundPipe is simulated by replaying the
runtime's own op programs (``roundpipe.core.program``) with a cost model
(docs/design.md#simulator).
"""

from .baselines import BASELINES, balanced_partition, simulate_baseline
from .costs import CostModel, LayerCosts
from .engine import SimulationError
from .result import Bubbles, SimResult
from .roundpipe_schedule import (
    round_schedules,
    simulate_roundpipe,
    steady_iteration_time,
)

__all__ = [
    "BASELINES",
    "Bubbles",
    "CostModel",
    "LayerCosts",
    "SimResult",
    "SimulationError",
    "balanced_partition",
    "round_schedules",
    "simulate_baseline",
    "simulate_roundpipe",
    "steady_iteration_time",
]

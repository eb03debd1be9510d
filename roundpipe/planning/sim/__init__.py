"""Discrete-event simulation of RoundPipe and of weight-bound pipeline baselines.

Pure logic: no threads, no devices, no torch. RoundPipe is simulated by replaying
the runtime's own lowered schedule (``roundpipe.core.schedule.lower``) with a cost model.
"""

from .baselines import BASELINES, balanced_partition, simulate_baseline
from .costs import HARDWARE_PRESETS, CostModel, Hardware, LayerCosts, hardware
from .engine import SimulationError
from .result import Bubbles, SimResult
from .roundpipe_schedule import (
    round_schedules,
    simulate_roundpipe,
    steady_iteration_time,
)

__all__ = [
    "BASELINES",
    "HARDWARE_PRESETS",
    "Bubbles",
    "CostModel",
    "Hardware",
    "LayerCosts",
    "SimResult",
    "SimulationError",
    "balanced_partition",
    "hardware",
    "round_schedules",
    "simulate_baseline",
    "simulate_roundpipe",
    "steady_iteration_time",
]

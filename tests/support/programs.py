"""Plans and the op programs they lower to, shared by the core tests: hypothesis
strategies for valid plans, random cases lowered to programs (``test_op_program.py``,
``test_op_vocabulary.py``) and the golden cases (``test_golden_programs.py``, whose
texts are ``tests/golden/<case>.txt``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st
from torch import nn

from roundpipe import JobKind, Plan, lower
from roundpipe.core.program import CallShape, JobProgram, job_program, plan_chunks, recompute_inputs
from roundpipe.core.schedule import Schedule

GOLDEN = Path(__file__).resolve().parents[1] / "golden"

# -- plans -------------------------------------------------------------------------------


def compositions(total: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Ordered ways to write ``total`` as a sum of positive integers."""
    if total == 0:
        return st.just(())
    return st.lists(st.booleans(), min_size=total - 1, max_size=total - 1).map(
        lambda cuts: composition_sizes(cuts)
    )


def composition_sizes(cuts: list[bool]) -> tuple[int, ...]:
    sizes, run = [], 1
    for cut in cuts:
        if cut:
            sizes.append(run)
            run = 1
        else:
            run += 1
    return (*sizes, run)


@st.composite
def plans(draw, min_layers: int = 1, max_layers: int = 10) -> Plan:
    layers = draw(st.integers(min_layers, max_layers))
    backward = draw(compositions(layers))
    forward = draw(compositions(layers - backward[0]))
    return Plan(forward, backward)


# -- programs of a schedule --------------------------------------------------------------


def call_shape(
    schedule: Schedule, microbatches: int, grain: str, rng_state: bool, outputs: bool
) -> CallShape:
    """The shape of a ``forward_backward`` call (not forward-only, not deferred)."""
    inputs = recompute_inputs(schedule, grain, forward_only=False, deferred=False)
    return CallShape(microbatches, grain, inputs, rng_state, outputs)


def model_programs(model: nn.Sequential, schedule: Schedule, shape: CallShape, chunk_bytes):
    """Every job's program, its weight chunks, buffers and write-back derived from the
    model the way the runtime's prefetch does."""
    programs = []
    for job in schedule.jobs:
        modules = [model[i] for i in job.layers]
        params = list({id(p): p for m in modules for p in m.parameters()}.values())
        chunks = plan_chunks(
            [p.numel() for p in params], [p.element_size() for p in params], chunk_bytes
        )
        has_buffers = any(True for m in modules for _ in m.buffers())
        writes_back = job.kind is not JobKind.BACKWARD and has_buffers
        programs.append(job_program(job, shape, len(chunks), has_buffers, writes_back))
    return programs


def synthetic_programs(schedule: Schedule, shape: CallShape, chunks: list[int], buffered: set):
    programs = []
    for job in schedule.jobs:
        has_buffers = any(i in buffered for i in job.layers)
        writes_back = job.kind is not JobKind.BACKWARD and has_buffers
        weight_chunks = chunks[job.index % len(chunks)]
        programs.append(job_program(job, shape, weight_chunks, has_buffers, writes_back))
    return programs


def programs_cases():
    return st.tuples(
        plans(max_layers=9),
        st.integers(1, 4),  # devices
        st.integers(1, 5),  # microbatches
        st.sampled_from(["stage", "layer"]),
        st.booleans(),  # preserve_rng_state
        st.booleans(),  # return_outputs
        st.lists(st.integers(0, 3), min_size=1, max_size=4),  # weight chunks per job
        st.sets(st.integers(0, 8), max_size=3),  # layers with buffers
    )


def lowered(case) -> tuple[Schedule, list[JobProgram]]:
    plan, devices, microbatches, grain, rng_state, outputs, chunks, buffered = case
    schedule = lower(plan, devices, 0)
    shape = call_shape(schedule, microbatches, grain, rng_state, outputs)
    return schedule, synthetic_programs(schedule, shape, chunks, buffered)


# -- the golden cases ------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    plan: Plan
    num_devices: int
    first_device: int
    num_microbatches: int
    recompute_grain: str
    preserve_rng_state: bool
    return_outputs: bool
    weight_chunks: int
    has_buffers: bool
    writes_back: bool


CASES = [
    Case(
        "plan_2_1_1_1",
        Plan((2,), (1, 1, 1)),
        num_devices=2,
        first_device=0,
        num_microbatches=3,
        recompute_grain="stage",
        preserve_rng_state=False,
        return_outputs=True,
        weight_chunks=1,
        has_buffers=False,
        writes_back=False,
    ),
    Case(
        "plan_1_1_1_2_layer_rng",
        Plan((1, 1), (1, 2)),
        num_devices=2,
        first_device=1,
        num_microbatches=2,
        recompute_grain="layer",
        preserve_rng_state=True,
        return_outputs=False,
        weight_chunks=2,
        has_buffers=True,
        writes_back=True,
    ),
]

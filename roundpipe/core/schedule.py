"""A plan lowered to the ordered stage jobs of one call, each placed on a device.

The runtime executes this list and the simulator replays it, so both agree by
construction on which device runs which job (docs/design.md#schedules).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from .plan import Plan


class JobKind(enum.Enum):
    FORWARD = "F"
    FUSED = "X"  # forward + loss + backward, no recompute
    BACKWARD = "B"  # recompute + backward


@dataclass(frozen=True)
class Job:
    """One stage job: a stage of the plan run for every microbatch on one device."""

    index: int
    kind: JobKind
    stage: int
    layers: range
    device: int
    input_from: int | None
    """Job whose per-microbatch output this job consumes (activation or gradient)."""
    saved_input_from: int | None
    """Forward job that saves this backward stage's input for recompute."""

    def __str__(self) -> str:
        return (
            f"{self.kind.value}{self.stage}@{self.device}[{self.layers.start}:{self.layers.stop}]"
        )

    @property
    def description(self) -> str:
        """The job in words, for errors: ``forward stage 0 (layers 0-2)``."""
        kind = {JobKind.FORWARD: "forward", JobKind.FUSED: "fused", JobKind.BACKWARD: "backward"}
        layers = f"layers {self.layers.start}-{self.layers.stop - 1}"
        return f"{kind[self.kind]} stage {self.stage} ({layers})"


@dataclass(frozen=True)
class Schedule:
    """The ordered jobs of one ``forward_backward`` call."""

    plan: Plan
    num_devices: int
    first_device: int
    jobs: tuple[Job, ...]

    @property
    def next_device(self) -> int:
        """Where the round-robin cursor stands after this call's jobs."""
        return (self.first_device + len(self.jobs)) % self.num_devices

    @property
    def next_cursor(self) -> int:
        """Where the next call's first job goes: :attr:`next_device`, or device 0 after
        a placed plan (``Plan.placed``: its stages are sized for the devices that run
        them, so every call places its jobs alike; docs/design.md#mixed-pools)."""
        return 0 if self.plan.placed else self.next_device

    @property
    def forward_jobs(self) -> tuple[Job, ...]:
        return tuple(j for j in self.jobs if j.kind is JobKind.FORWARD)

    @property
    def backward_jobs(self) -> tuple[Job, ...]:
        return tuple(j for j in self.jobs if j.kind is not JobKind.FORWARD)

    def saved_boundaries(self) -> frozenset[int]:
        """Layer indices whose input the forward pass keeps for recompute (stage grain)."""
        return frozenset(j.layers.start for j in self.jobs if j.kind is JobKind.BACKWARD)

    def devices_of(self) -> list[int]:
        return [j.device for j in self.jobs]

    def __str__(self) -> str:
        return " ".join(str(j) for j in self.jobs)


def lower(plan: Plan, num_devices: int, first_device: int = 0) -> Schedule:
    """Lower ``plan`` to the ordered job list for a pool of ``num_devices`` devices."""
    forward = [(JobKind.FORWARD, stage, r) for stage, r in enumerate(plan.forward_ranges())]
    backward = [
        (JobKind.FUSED if stage == 0 else JobKind.BACKWARD, stage, r)
        for stage, r in enumerate(plan.backward_ranges())
    ]
    return _schedule(plan, num_devices, first_device, forward + backward)


def lower_unfused(
    plan: Plan, num_devices: int, first_device: int = 0, with_backward: bool = False
) -> Schedule:
    """Forward jobs over every layer (the fused stage run as one more forward stage),
    then, ``with_backward``, every backward stage as a recomputing backward job.

    Used when the loss is not part of the call: inference, and ``model(x)`` followed
    by a later ``.backward()`` on its output.
    """
    ranges = [*plan.forward_ranges(), plan.fused_range()]
    stages = [(JobKind.FORWARD, stage, r) for stage, r in enumerate(ranges)]
    if with_backward:
        stages += [(JobKind.BACKWARD, stage, r) for stage, r in enumerate(plan.backward_ranges())]
    return _schedule(plan, num_devices, first_device, stages)


def _schedule(
    plan: Plan, num_devices: int, first_device: int, stages: list[tuple[JobKind, int, range]]
) -> Schedule:
    """Jobs for ``stages`` in order, round-robin from ``first_device`` (from device 0
    for a placed plan); a backward job recomputes from the input saved by the forward
    job that ran its first layer."""
    if num_devices < 1:
        raise ValueError(f"num_devices must be at least 1, got {num_devices}")
    plan.validate(plan.num_layers)
    first_device = 0 if plan.placed else first_device % num_devices  # placed: job j on j mod N
    forward_job_of_layer = {
        layer: index
        for index, (kind, _, layers) in enumerate(stages)
        if kind is JobKind.FORWARD
        for layer in layers
    }
    jobs = tuple(
        Job(
            index=index,
            kind=kind,
            stage=stage,
            layers=layers,
            device=(first_device + index) % num_devices,
            input_from=index - 1 if index else None,
            saved_input_from=(
                forward_job_of_layer[layers.start] if kind is JobKind.BACKWARD else None
            ),
        )
        for index, (kind, stage, layers) in enumerate(stages)
    )
    return Schedule(plan=plan, num_devices=num_devices, first_device=first_device, jobs=jobs)

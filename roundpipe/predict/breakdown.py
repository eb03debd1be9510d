"""Where the bytes go: host RAM and the fullest GPU's memory of a RoundPipe prediction,
term by term, and the usable share of each that the terms' sum is judged against.

This module owns the memory accounting of docs/design.md#prediction-assumptions: the
prediction's fit answers are the sums of these terms, and ``roundpipe simulate`` prints
the same terms, so what it explains is what it decided.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..core.plan import Plan
from ..planning.rules import devices_visited
from ..planning.sim.costs import CostModel
from .host_settings import (
    DEFAULT_SETTINGS,
    MASTER_COPY_BYTES,
    MASTER_GRADIENT_BYTES,
    LeanSettings,
    moment_bytes,
    nf4_bytes,
)
from .unit_costs import FP32, HALF

MEMORY_HEADROOM = 0.9
"""The usable fraction of a GPU's memory (CUDA context, allocator) and of the host's
RAM (the OS, the data loader)."""
MASTER_BYTES = FP32
GRADIENT_BYTES = FP32
"""The host accumulates every trained parameter's gradient in fp32."""
ADAM_STATE_BYTES = 2 * FP32
"""Adam's m and v in fp32."""
HOST_BYTES_TRAINABLE = 2 * HALF + MASTER_BYTES + GRADIENT_BYTES + ADAM_STATE_BYTES
"""Per trained parameter with the default settings: its two upload buffers (the weights
and the spare version, docs/design.md#weight-versions), the master, the gradient and
Adam's state: 20 B (the lean settings' bytes are :mod:`.host_settings`')."""
SHARDED_HOST_BYTES = MASTER_BYTES + ADAM_STATE_BYTES
"""Of ``HOST_BYTES_TRAINABLE``, the fp32 master and Adam m and v: what ``optimizer_shards``
hosts split (the fp32 gradient stays whole: rounds accumulate into all of it)."""
PINNED_CACHE_BYTES = 2**30
"""Idle page-locked download blocks the device pool keeps for reuse
(``roundpipe.devices.host_blocks.DEFAULT_CACHE_BYTES``; the blocks in use hold the saved
activations, counted apart)."""


@dataclass(frozen=True)
class Budget:
    """What a memory offers: its capacity and the fraction of it a run may use."""

    capacity: int
    usable_fraction: float = MEMORY_HEADROOM

    @property
    def available(self) -> int:
        return int(self.capacity * self.usable_fraction)


@dataclass(frozen=True)
class _Terms:
    """Named byte counts whose sum is what the memory must hold."""

    def terms(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def total(self) -> int:
        return sum(self.terms().values())

    def to_dict(self, budget: Budget | None) -> dict:
        row: dict = {**self.terms(), "total": self.total}
        if budget is not None:
            row.update(
                available=budget.available,
                capacity=budget.capacity,
                usable_fraction=budget.usable_fraction,
            )
        return row


@dataclass(frozen=True)
class HostRam(_Terms):
    """Host RAM of RoundPipe: all training state lives here."""

    weights: int
    """Every parameter's upload buffer in the model dtype (a LoRA base's frozen ones too;
    its decoder layers' linear weights in NF4 when quantized)."""
    spare: int
    """The second weight version of each trained parameter, in the model dtype."""
    masters: int
    gradients: int
    optimizer_state: int
    saved_activations: int
    """The inputs of every backward stage but the fused one, for a round's microbatches."""
    pinned_buffers: int


@dataclass(frozen=True)
class DeviceMemory(_Terms):
    """The fullest GPU at its peak: a stage running while the next one's weights arrive."""

    weights: int
    prefetched_weights: int
    gradients: int
    saved_activations: int
    """A backward stage's layers' activations (recomputed), or a forward stage's largest
    layer's working set."""


@dataclass(frozen=True)
class MemoryFit:
    """RoundPipe's memory on one box and the verdicts: each is its terms' sum against
    the usable share of its budget."""

    plan: Plan | None
    """The plan the terms are of; ``None`` when no plan fits the GPUs (the terms are then
    the finest plan's, the least any plan needs, and ``no_plan`` says why)."""
    device: DeviceMemory
    gpu: Budget
    host: HostRam
    host_budget: Budget | None
    """``None`` when the host's RAM is unknown: the host is then not judged."""
    no_plan: str = ""

    @property
    def fits(self) -> bool:
        return self.plan is not None and self.device.total <= self.gpu.available

    @property
    def host_fits(self) -> bool | None:
        if self.host_budget is None:
            return None
        return self.host.total <= self.host_budget.available

    @property
    def fits_all(self) -> bool:
        return self.fits and self.host_fits is not False

    def to_dict(self) -> dict:
        return {
            "host_ram": self.host.to_dict(self.host_budget),
            "device_memory": self.device.to_dict(self.gpu),
        }


def host_ram_terms(
    trainable: int,
    frozen: int,
    optimizer_shards: int,
    plan: Plan,
    round_microbatches: int,
    boundary_bytes: int,
    settings: LeanSettings = DEFAULT_SETTINGS,
    quantized: int = 0,
    weight_bytes: int = HALF,
) -> HostRam:
    """Host RAM of a RoundPipe run of ``plan``: ``trainable`` parameters trained (their
    masters and Adam state split over ``optimizer_shards`` hosts), ``frozen`` held only,
    ``quantized`` of them in NF4; ``settings`` say in which dtypes (async steps: the
    spare version is there whatever the masters). ``boundary_bytes`` are a microbatch's
    hidden states in half precision; an fp32 model (``weight_bytes`` 4) holds its
    weights and hidden states in fp32, and its fp32 masters are its own weights."""
    master = 0 if weight_bytes == FP32 else MASTER_COPY_BYTES[settings.master_weights]
    saved_inputs = (len(plan.backward) - 1) * round_microbatches * boundary_bytes
    return HostRam(
        weights=(trainable + frozen - quantized) * weight_bytes + nf4_bytes(quantized),
        spare=trainable * weight_bytes,
        masters=-(-trainable * master // optimizer_shards),
        gradients=trainable * MASTER_GRADIENT_BYTES[settings.master_weights],
        optimizer_state=moment_bytes(trainable, settings.optimizer_states, optimizer_shards),
        saved_activations=saved_inputs * weight_bytes // HALF,
        pinned_buffers=PINNED_CACHE_BYTES,
    )


def device_memory_terms(costs: CostModel, plan: Plan) -> DeviceMemory:
    """The peak of ``plan`` on one GPU: the stage whose weights, gradients and
    activations, with the biggest stage's weights prefetched beside them, are most (a
    stage's own part is the planner's ``stage_footprint``)."""
    return max((peak for _, peak in stage_peaks(costs, plan)), key=lambda peak: peak.total)


def stage_peaks(costs: CostModel, plan: Plan) -> list[tuple[range, DeviceMemory]]:
    """Every stage of ``plan`` (forward stages first) and the GPU memory it peaks at."""
    layers = costs.layers
    stages = [(r, False) for r in plan.forward_ranges()]
    stages += [(r, True) for r in plan.backward_ranges()]
    prefetched = max(layers.stage_param_bytes(r) for r, _ in stages)
    peaks = []
    for r, backward in stages:
        weights = layers.stage_param_bytes(r)
        if backward:
            gradients = int(weights * costs.grad_bytes_ratio)
            activations = layers.stage_activation_bytes(r)
        else:
            gradients, activations = 0, max(layers.activation_bytes[i] for i in r)
        peaks.append((r, DeviceMemory(weights, prefetched, gradients, activations)))
    return peaks


def device_peaks(costs: CostModel, plan: Plan, num_devices: int) -> list[DeviceMemory]:
    """Each device's peak under ``plan``: the fullest of the stages that land on it (on a
    placed plan job j always runs on device j mod N), with the biggest of their weights
    prefetched beside it; a device no stage lands on holds nothing."""
    stages = stage_peaks(costs, plan)
    visited = devices_visited(plan, num_devices)
    peaks = []
    for device in range(num_devices):
        own = [peak for (_, peak), on in zip(stages, visited, strict=True) if device in on]
        prefetched = max((peak.weights for peak in own), default=0)
        own = [replace(peak, prefetched_weights=prefetched) for peak in own]
        peaks.append(max(own, key=lambda peak: peak.total, default=DeviceMemory(0, 0, 0, 0)))
    return peaks


def finest_plan(num_units: int) -> Plan:
    """One unit per stage: the plan that needs least GPU memory (each layer recomputed
    alone); the head is the last unit, the fused stage."""
    return Plan((1,) * (num_units - 1), (1,) * num_units)

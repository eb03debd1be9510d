"""Model-level prediction: "will it fit on my box, how fast, and against what?".

From a model's shapes (:mod:`.model_specs`), a GPU (:mod:`.gpus`) and a workload, price
every pipeline unit (:mod:`.unit_costs`), simulate RoundPipe with the automatic plan and
the weight-bound baselines, and answer: tokens/s, per-GPU memory, host RAM, whether each
fits, and the longest sequence that fits. The assumptions are stated in
docs/design.md#prediction-assumptions.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from ..core.plan import Plan, PlanError
from ..core.tiling import DEFAULT_SEQ_CHUNK_TOKENS
from ..planning.partition import auto_plan, paper_greedy_plan, step_objective
from ..planning.sim.baselines import BASELINES, simulate_baseline
from ..planning.sim.costs import CostModel
from ..planning.sim.roundpipe_schedule import isolated_iteration_time, steady_iteration_time
from .breakdown import (
    Budget,
    MemoryFit,
    device_memory_terms,
    finest_plan,
    host_ram_terms,
    stage_peaks,
)
from .gpus import Gpu
from .longest import Longest, MemoryAt, search
from .model_costs import (
    ADAM_BYTES,
    DEFAULT_HOST_BANDWIDTH,
    PricedModel,
    Workload,
    cost_model,
    host_round_time,
)
from .model_specs import MODEL_PRESETS, ModelSpec, model_preset

__all__ = [
    "ADAM_BYTES",
    "DEFAULT_HOST_BANDWIDTH",
    "MODEL_PRESETS",
    "ModelSpec",
    "Prediction",
    "PricedModel",
    "Workload",
    "cost_model",
    "host_round_time",
    "model_preset",
    "predict",
    "roundpipe_speed",
]


@dataclass(frozen=True)
class Prediction:
    schedule: str
    tokens_per_s: float
    iteration_time: float
    """Seconds per iteration of the whole batch."""
    gpu_memory: int
    """Peak bytes on the fullest GPU."""
    gpu_budget: int
    fits: bool
    host_ram: int | None
    host_ram_budget: int | None
    host_ram_fits: bool | None
    detail: str
    max_seq_len: int | None = None
    memory: MemoryFit | None = None
    """RoundPipe's memory term by term: ``gpu_memory`` and ``host_ram`` are its sums."""

    @classmethod
    def of_roundpipe(cls, memory: MemoryFit, **rest) -> Prediction:
        """RoundPipe's prediction, its memory figures and verdicts read from ``memory``."""
        return cls(
            schedule="roundpipe",
            gpu_memory=memory.device.total,
            gpu_budget=memory.gpu.available,
            fits=memory.fits,
            host_ram=memory.host.total,
            host_ram_budget=None if memory.host_budget is None else memory.host_budget.available,
            host_ram_fits=memory.host_fits,
            memory=memory,
            **rest,
        )

    def to_dict(self) -> dict:
        """Flat figures; RoundPipe's ``host_ram`` and ``device_memory`` are breakdowns."""
        row = {k: v for k, v in self.__dict__.items() if k != "memory"}
        row["device_memory"] = None
        if self.memory is not None:
            row.update(self.memory.to_dict())
        return row


def predict(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    schedules: tuple[str, ...] = ("roundpipe", *BASELINES),
    host_ram: int | None = None,
) -> list[Prediction]:
    """Tokens/s, memory and fit of each schedule for this model, box and workload
    (RoundPipe without a plan that fits the GPUs: 0 tokens/s, the reason as detail)."""
    model = PricedModel.build(spec, gpu, work, work.tokens_per_microbatch)
    sim_microbatches = work.round_microbatches(num_gpus)
    costs = cost_model(model, gpu, work, num_gpus, sim_microbatches)
    return [
        _roundpipe(model, costs, gpu, work, num_gpus, host_ram)
        if name == "roundpipe"
        else _baseline(name, costs, gpu, work, num_gpus)
        for name in schedules
    ]


def _roundpipe(
    model: PricedModel,
    costs: CostModel,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    host_ram: int | None,
) -> Prediction:
    memory = _memory_fit(model, costs, gpu, work, num_gpus, host_ram)
    longest = max_seq_len(model.spec, gpu, work).max_seq_len
    if memory.plan is None:
        return Prediction.of_roundpipe(
            memory, tokens_per_s=0.0, iteration_time=0.0, detail=memory.no_plan, max_seq_len=longest
        )
    tokens_per_s, detail = roundpipe_speed(memory.plan, model, costs, work, num_gpus)
    return Prediction.of_roundpipe(
        memory,
        tokens_per_s=tokens_per_s,
        iteration_time=work.batch * work.seq_len / tokens_per_s,
        detail=detail,
        max_seq_len=longest,
    )


def roundpipe_speed(
    plan: Plan, model: PricedModel, costs: CostModel, work: Workload, num_gpus: int
) -> tuple[float, str]:
    """RoundPipe's tokens/s with ``plan`` (the simulated round, or the host memory's time
    for it when that is longer), and a detail saying how it was found."""
    sim_microbatches = work.round_microbatches(num_gpus)
    sim_time = _round_time(plan, costs, work, num_gpus, sim_microbatches)
    host_time = host_round_time(model, work, num_gpus, sim_microbatches)
    detail = f"plan {plan}, rounds of {sim_microbatches} microbatches"
    if work.step == "sync":
        detail += ", synchronous steps (each batch's last round stands alone)"
    if host_time > sim_time:
        detail += f", host-memory bound ({sim_time:.2f} s simulated, {host_time:.2f} s host)"
        sim_time = host_time
    return sim_microbatches * work.tokens_per_microbatch / sim_time, detail


def _round_time(
    plan: Plan, costs: CostModel, work: Workload, num_gpus: int, sim_microbatches: int
) -> float:
    """Seconds per round of ``sim_microbatches``. Asynchronous steps: the steady state.
    Synchronous: the rounds of a batch but its last overlap as in the steady state
    without a step; the last one stands alone, until the batch's whole step is done."""
    steady = functools.partial(
        steady_iteration_time, plan, num_devices=num_gpus, num_microbatches=sim_microbatches
    )
    if work.step != "sync":
        return steady(costs, round_size=sim_microbatches)
    rounds = work.num_microbatches / sim_microbatches
    whole_step = costs.optimizer_time * rounds
    overlapped = steady(replace(costs, optimizer_time=0.0), round_size=sim_microbatches)
    last = isolated_iteration_time(
        plan,
        replace(costs, optimizer_time=whole_step),
        num_gpus,
        sim_microbatches,
        round_size=sim_microbatches,
    )
    return ((rounds - 1) * overlapped + last) / rounds


def _baseline(name: str, costs: CostModel, gpu: Gpu, work: Workload, num_gpus: int) -> Prediction:
    budget = Budget(gpu.memory_bytes).available
    sim_microbatches = work.round_microbatches(num_gpus)
    try:
        result = simulate_baseline(name, costs, num_gpus, sim_microbatches)
    except ValueError as unsupported:
        return Prediction(name, 0.0, 0.0, 0, budget, False, None, None, None, str(unsupported))
    sim_time, peak = result.iteration_time or result.makespan, max(result.peak_memory)
    tokens_per_s = sim_microbatches * work.tokens_per_microbatch / sim_time
    return Prediction(
        schedule=name,
        tokens_per_s=tokens_per_s,
        iteration_time=work.batch * work.seq_len / tokens_per_s,
        gpu_memory=peak,
        gpu_budget=budget,
        fits=peak <= budget,
        host_ram=None,
        host_ram_budget=None,
        host_ram_fits=None,
        detail=result.detail,
    )


def memory_fit(
    spec: ModelSpec, gpu: Gpu, work: Workload, num_gpus: int, host_ram: int | None = None
) -> MemoryFit:
    """RoundPipe's memory and whether it fits, without timing the iteration (what
    :func:`predict` answers for its ``"roundpipe"`` row, at the cost of a plan only)."""
    model = PricedModel.build(spec, gpu, work, work.tokens_per_microbatch)
    costs = cost_model(model, gpu, work, num_gpus, work.round_microbatches(num_gpus))
    return _memory_fit(model, costs, gpu, work, num_gpus, host_ram)


def _memory_fit(
    model: PricedModel,
    costs: CostModel,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    host_ram: int | None,
) -> MemoryFit:
    """The automatic plan's memory (the greedy one's with ``work.greedy_plan``), or the
    finest plan's when none fits the GPUs."""
    round_microbatches = work.round_microbatches(num_gpus)
    objective = step_objective(work.step != "sync")
    try:
        if work.greedy_plan:
            plan = paper_greedy_plan(costs.layers)
        else:
            plan = roundpipe_plan(costs, gpu, num_gpus, round_microbatches, objective)
        no_plan = ""
        terms_plan = plan
    except PlanError as error:
        plan, no_plan = None, str(error)
        terms_plan = finest_plan(len(model.units))
    host = host_ram_terms(
        model.trainable,
        model.frozen,
        work.optimizer_shards,
        terms_plan,
        round_microbatches,
        costs.layers.boundary_bytes,
        work.settings,
        model.quantized,
        work.weight_bytes,
    )
    return MemoryFit(
        plan=plan,
        device=device_memory_terms(costs, terms_plan),
        gpu=Budget(gpu.memory_bytes),
        host=host,
        host_budget=None if host_ram is None else Budget(host_ram),
        no_plan=no_plan,
    )


def roundpipe_plan(
    costs: CostModel, gpu: Gpu, num_gpus: int, sim_microbatches: int, objective: str = "steady"
) -> Plan:
    """The automatic plan, unrefined, for rounds of ``sim_microbatches`` (``objective``:
    ``"makespan"`` for synchronous steps, :func:`roundpipe.planning.partition.auto_plan`)."""
    budget = Budget(gpu.memory_bytes).available
    return auto_plan(
        costs,
        num_gpus,
        sim_microbatches,
        [budget] * num_gpus,
        round_size=sim_microbatches,
        refine=False,
        objective=objective,
    )


def max_seq_len(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    host_ram: int | None = None,
    seq_chunk_tokens: int | None = DEFAULT_SEQ_CHUNK_TOKENS,
) -> Longest:
    """The longest sequence that trains at batch 1 with one layer per stage (the plan
    that needs least GPU memory: each layer recomputed alone from its saved input),
    layers tiled in chunks of ``seq_chunk_tokens`` (``None``: untiled, the paper's
    law; always for a spec without ``tiled_layers``), against the GPU and, when
    ``host_ram`` is given, the host's RAM."""

    if not spec.tiled_layers:
        seq_chunk_tokens = None  # the general path runs the model's own layers

    def measure(seq_len: int) -> MemoryAt:
        return memory_at(spec, gpu, work, seq_len, seq_chunk_tokens)

    host_budget = None if host_ram is None else Budget(host_ram).available
    longest = search(measure, Budget(gpu.memory_bytes).available, host_budget)
    return replace(longest, seq_chunk_tokens=seq_chunk_tokens)


def memory_at(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    seq_len: int,
    seq_chunk_tokens: int | None = DEFAULT_SEQ_CHUNK_TOKENS,
) -> MemoryAt:
    """What one sequence of ``seq_len`` tokens needs on the fullest GPU (one layer per
    stage) and on the host (every layer's input saved)."""
    at = replace(
        work, seq_len=seq_len, batch=1, microbatch_size=1, seq_chunk_tokens=seq_chunk_tokens
    )
    model = PricedModel.build(spec, gpu, at, seq_len)
    costs = cost_model(model, gpu, at, 1, 1)
    plan = finest_plan(len(model.units))
    stage, device = max(stage_peaks(costs, plan), key=lambda peak: peak[1].total)
    host = host_ram_terms(
        model.trainable,
        model.frozen,
        at.optimizer_shards,
        plan,
        1,
        costs.layers.boundary_bytes,
        at.settings,
        model.quantized,
        at.weight_bytes,
    )
    return MemoryAt(device, _unit_name(stage.start, len(model.units)), host)


def _unit_name(index: int, num_units: int) -> str:
    if index == 0:
        return "the embedding"
    if index == num_units - 1:
        return "the head (final norm, LM head, loss)"
    return f"decoder layer {index - 1}"

"""Model-level prediction: "will it fit on my box, how fast, and against what?".

From a model's shapes (:mod:`.model_specs`), a GPU (:mod:`.gpus`) and a workload, price
every pipeline unit (:mod:`.unit_costs`), simulate RoundPipe with the automatic plan and
the weight-bound baselines, and answer: tokens/s, per-GPU memory, host RAM, whether each
fits, and the longest sequence that fits. The assumptions are stated in
docs/design.md#prediction-assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.plan import Plan, PlanError
from ..core.tiling import DEFAULT_SEQ_CHUNK_TOKENS
from ..planning.partition import auto_plan
from ..planning.sim.baselines import BASELINES, simulate_baseline
from ..planning.sim.costs import CostModel, LayerCosts
from ..planning.sim.roundpipe_schedule import steady_iteration_time
from .breakdown import (
    SHARDED_HOST_BYTES,
    Budget,
    MemoryFit,
    device_memory_terms,
    finest_plan,
    host_ram_terms,
    stage_peaks,
)
from .gpus import PCIE_BANDWIDTH, Gpu
from .host_settings import DEFAULT_SETTINGS, LeanSettings
from .longest import Longest, MemoryAt, search
from .model_specs import MODEL_PRESETS, ModelSpec, model_preset
from .unit_costs import HALF, Kernels, UnitCost, embedding_cost, head_cost, layer_cost

__all__ = ["MODEL_PRESETS", "ModelSpec", "Prediction", "Workload", "model_preset", "predict"]

ROUND_PER_GPU = 4
"""Default round (one ``forward_backward`` call): this many microbatches per GPU."""
ADAM_BYTES = 34  # read grad, master, m, v; write master, m, v, half weights; zero grad
GRAD_ACCUMULATE_BYTES = 10  # read the half gradient and the fp32 sum, write the sum
DEVICE_OPTIMIZER_RATIO = SHARDED_HOST_BYTES / HALF  # baselines: master, m, v per half weight
DEFAULT_HOST_BANDWIDTH = 200e9
"""Host memory bytes/s for copies and the optimizer (a two-socket server's DDR4)."""


@dataclass(frozen=True)
class Workload:
    """What one iteration trains on, and on which settings."""

    seq_len: int
    batch: int
    """Sequences per iteration."""
    microbatch_size: int = 1
    mfu: float | None = None
    """Matmul efficiency override (fraction of the dense tensor peak)."""
    precision: str = "bf16"
    lora_rank: int = 0
    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH
    pcie: int | None = None
    """PCIe generation (default: the GPU's)."""
    round_size: int | None = None
    """Microbatches per round (default ``ROUND_PER_GPU`` per GPU, at most the batch)."""
    optimizer_shards: int = 1
    """Hosts that each step 1/K of the masters (nodes of data parallelism)."""
    settings: LeanSettings = DEFAULT_SETTINGS
    """The dtypes the host keeps the optimizer's state, masters and a LoRA base in."""
    seq_chunk_tokens: int | None = None
    """Decoder layers' MLPs and norms tiled in chunks of this many tokens, the loss
    chunked as ``roundpipe.hf`` does it (docs/design.md#long-context); ``None``: the
    untiled layers and the calibrated head of the paper's measurements."""

    def round_microbatches(self, num_gpus: int) -> int:
        return min(self.num_microbatches, self.round_size or ROUND_PER_GPU * num_gpus)

    @property
    def num_microbatches(self) -> int:
        return -(-self.batch // self.microbatch_size)

    @property
    def tokens_per_microbatch(self) -> int:
        return self.microbatch_size * self.seq_len


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


@dataclass(frozen=True)
class _Model:
    """The per-unit costs of one model, GPU and workload, and their totals."""

    spec: ModelSpec
    units: list[UnitCost]
    trainable: int
    frozen: int
    quantized: int = 0
    """Of the frozen parameters, those held and uploaded in NF4."""

    @classmethod
    def build(cls, spec: ModelSpec, gpu: Gpu, work: Workload, tokens: int) -> _Model:
        rank, nf4 = work.lora_rank, work.settings.quantize == "nf4"
        kernels = Kernels(gpu, work.precision, work.mfu)
        chunk = work.seq_chunk_tokens
        full = layer_cost(spec, kernels, tokens, work.seq_len, None, rank, nf4, chunk)
        window = None
        if spec.window_layers:
            window = layer_cost(
                spec, kernels, tokens, work.seq_len, spec.sliding_window, rank, nf4, chunk
            )
        # gpt-oss alternates sliding and full layers; others have all or none windowed
        every = spec.num_layers // max(spec.window_layers, 1)
        layers = [
            window if window is not None and i % every == 0 else full
            for i in range(spec.num_layers)
        ]
        units = [
            embedding_cost(spec, kernels, tokens, rank > 0),
            *layers,
            head_cost(spec, kernels, tokens, rank > 0, chunk),
        ]
        trainable = spec.lora_params(rank) if rank else spec.num_params
        frozen = spec.num_params if rank else 0
        quantized = spec.num_layers * spec.linear_weight_params if nf4 else 0
        return cls(spec, units, trainable, frozen, quantized)

    @property
    def upload_bytes(self) -> int:
        return sum(u.param_bytes for u in self.units)


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
    model = _Model.build(spec, gpu, work, work.tokens_per_microbatch)
    sim_microbatches = work.round_microbatches(num_gpus)
    costs = cost_model(model, gpu, work, num_gpus, sim_microbatches)
    return [
        _roundpipe(model, costs, gpu, work, num_gpus, host_ram)
        if name == "roundpipe"
        else _baseline(name, costs, gpu, work, num_gpus)
        for name in schedules
    ]


def _roundpipe(
    model: _Model, costs: CostModel, gpu: Gpu, work: Workload, num_gpus: int, host_ram: int | None
) -> Prediction:
    memory = _memory_fit(model, costs, gpu, work, num_gpus, host_ram)
    longest = max_seq_len(model.spec, gpu, work).max_seq_len
    if memory.plan is None:
        return Prediction.of_roundpipe(
            memory, tokens_per_s=0.0, iteration_time=0.0, detail=memory.no_plan, max_seq_len=longest
        )
    sim_microbatches = work.round_microbatches(num_gpus)
    sim_time = steady_iteration_time(
        memory.plan, costs, num_gpus, sim_microbatches, round_size=sim_microbatches
    )
    host_time = host_round_time(model, work, num_gpus, sim_microbatches)
    detail = f"plan {memory.plan}, rounds of {sim_microbatches} microbatches"
    if host_time > sim_time:
        detail += f", host-memory bound ({sim_time:.2f} s simulated, {host_time:.2f} s host)"
        sim_time = host_time
    tokens_per_s = sim_microbatches * work.tokens_per_microbatch / sim_time
    return Prediction.of_roundpipe(
        memory,
        tokens_per_s=tokens_per_s,
        iteration_time=work.batch * work.seq_len / tokens_per_s,
        detail=detail,
        max_seq_len=longest,
    )


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
    model = _Model.build(spec, gpu, work, work.tokens_per_microbatch)
    costs = cost_model(model, gpu, work, num_gpus, work.round_microbatches(num_gpus))
    return _memory_fit(model, costs, gpu, work, num_gpus, host_ram)


def _memory_fit(
    model: _Model,
    costs: CostModel,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    host_ram: int | None,
) -> MemoryFit:
    """The automatic plan's memory, or the finest plan's when none fits the GPUs."""
    round_microbatches = work.round_microbatches(num_gpus)
    try:
        plan, no_plan = roundpipe_plan(costs, gpu, num_gpus, round_microbatches), ""
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
    )
    return MemoryFit(
        plan=plan,
        device=device_memory_terms(costs, terms_plan),
        gpu=Budget(gpu.memory_bytes),
        host=host,
        host_budget=None if host_ram is None else Budget(host_ram),
        no_plan=no_plan,
    )


def roundpipe_plan(costs: CostModel, gpu: Gpu, num_gpus: int, sim_microbatches: int) -> Plan:
    """The automatic plan, unrefined, for rounds of ``sim_microbatches``."""
    budget = Budget(gpu.memory_bytes).available
    return auto_plan(
        costs,
        num_gpus,
        sim_microbatches,
        [budget] * num_gpus,
        round_size=sim_microbatches,
        refine=False,
    )


def cost_model(
    model: _Model, gpu: Gpu, work: Workload, num_gpus: int, sim_microbatches: int
) -> CostModel:
    """The simulator's costs of one round of ``sim_microbatches`` of the workload."""
    units = model.units
    boundary = work.tokens_per_microbatch * model.spec.hidden_size * HALF
    upload = model.upload_bytes
    grads = model.trainable * HALF
    pcie = PCIE_BANDWIDTH[work.pcie] if work.pcie else gpu.pcie_bandwidth
    layers = LayerCosts(
        forward=tuple(u.forward for u in units),
        backward=tuple(u.backward for u in units),
        param_bytes=tuple(u.param_bytes for u in units),
        activation_bytes=tuple(u.activation_bytes for u in units),
        boundary_bytes=boundary,
    )
    # the step streams its bytes at the host's bandwidth, once per whole batch
    step = model.trainable * ADAM_BYTES / work.host_bandwidth / work.optimizer_shards
    return CostModel(
        layers=layers,
        comm=2 * boundary / pcie,
        h2d_bandwidth=pcie,
        d2h_bandwidth=pcie,
        optimizer_time=step * sim_microbatches / work.num_microbatches,
        grad_bytes_ratio=grads / upload,
        device_optimizer_ratio=DEVICE_OPTIMIZER_RATIO * grads / upload,
    )


def host_round_time(model: _Model, work: Workload, num_gpus: int, round_size: int) -> float:
    """Seconds the host memory needs per round for every copy and its share of the step."""
    boundary = work.tokens_per_microbatch * model.spec.hidden_size * HALF
    hops = round_size * 2 * (2 * num_gpus) * boundary  # both ways, forward and backward
    weights = 2 * model.upload_bytes + model.trainable * (HALF + GRAD_ACCUMULATE_BYTES)
    step = model.trainable * ADAM_BYTES * round_size / work.num_microbatches
    step /= work.optimizer_shards
    return (hops + weights + step) / work.host_bandwidth


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
    law), against the GPU and, when ``host_ram`` is given, the host's RAM."""

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
    model = _Model.build(spec, gpu, at, seq_len)
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
    )
    return MemoryAt(device, _unit_name(stage.start, len(model.units)), host)


def _unit_name(index: int, num_units: int) -> str:
    if index == 0:
        return "the embedding"
    if index == num_units - 1:
        return "the head (final norm, LM head, loss)"
    return f"decoder layer {index - 1}"

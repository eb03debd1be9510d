"""Model-level prediction: "will it fit on my box, how fast, and against what?".

From a model's shapes (:mod:`.model_specs`), a GPU (:mod:`.gpus`) and a workload, price
every pipeline unit (:mod:`.unit_costs`), simulate RoundPipe with the automatic plan and
the weight-bound baselines, and answer: tokens/s, per-GPU memory, host RAM, whether each
fits, and the longest sequence that fits. The assumptions are stated in
docs/design.md#prediction-assumptions.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.plan import Plan
from ..planning.partition import auto_plan
from ..planning.sim.baselines import BASELINES, simulate_baseline
from ..planning.sim.costs import CostModel, LayerCosts
from ..planning.sim.roundpipe_schedule import steady_iteration_time
from .gpus import PCIE_BANDWIDTH, Gpu
from .model_specs import MODEL_PRESETS, ModelSpec, model_preset
from .unit_costs import HALF, Kernels, UnitCost, embedding_cost, head_cost, layer_cost

__all__ = ["MODEL_PRESETS", "ModelSpec", "Prediction", "Workload", "model_preset", "predict"]

ROUND_PER_GPU = 4
"""Default round (one ``forward_backward`` call): this many microbatches per GPU."""
ADAM_BYTES = 34  # read grad, master, m, v; write master, m, v, half weights; zero grad
GRAD_ACCUMULATE_BYTES = 10  # read the half gradient and the fp32 sum, write the sum
HOST_BYTES_TRAINABLE = 20
SHARDED_HOST_BYTES = 12
"""Of ``HOST_BYTES_TRAINABLE``, the fp32 master and Adam m and v: what ``optimizer_shards``
hosts split (the fp32 gradient stays whole: rounds accumulate into all of it)."""
DEVICE_OPTIMIZER_RATIO = 6.0  # fp32 master + m + v (12 B) per half-precision weight (2 B)
MEMORY_HEADROOM = 0.9
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

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class _Model:
    """The per-unit costs of one model, GPU and workload, and their totals."""

    spec: ModelSpec
    units: list[UnitCost]
    trainable: int
    frozen: int

    @classmethod
    def build(cls, spec: ModelSpec, gpu: Gpu, work: Workload, tokens: int) -> _Model:
        rank = work.lora_rank
        kernels = Kernels(gpu, work.precision, work.mfu)
        full, window = layer_cost(spec, kernels, tokens, work.seq_len, None, rank), None
        if spec.window_layers:
            window = layer_cost(spec, kernels, tokens, work.seq_len, spec.sliding_window, rank)
        # gpt-oss alternates sliding and full layers; others have all or none windowed
        every = spec.num_layers // max(spec.window_layers, 1)
        layers = [
            window if window is not None and i % every == 0 else full
            for i in range(spec.num_layers)
        ]
        units = [
            embedding_cost(spec, kernels, tokens, rank > 0),
            *layers,
            head_cost(spec, kernels, tokens, rank > 0),
        ]
        trainable = spec.lora_params(rank) if rank else spec.num_params
        frozen = spec.num_params if rank else 0
        return cls(spec, units, trainable, frozen)

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
    """Tokens/s, memory and fit of each schedule for this model, box and workload."""
    model = _Model.build(spec, gpu, work, work.tokens_per_microbatch)
    sim_microbatches = work.round_microbatches(num_gpus)
    costs = cost_model(model, gpu, work, num_gpus, sim_microbatches)
    budget = int(gpu.memory_bytes * MEMORY_HEADROOM)
    host_budget = None if host_ram is None else int(host_ram * MEMORY_HEADROOM)
    sim_tokens = sim_microbatches * work.tokens_per_microbatch
    predictions = []
    for name in schedules:
        if name == "roundpipe":
            plan = roundpipe_plan(costs, gpu, num_gpus, sim_microbatches)
            sim_time = steady_iteration_time(
                plan, costs, num_gpus, sim_microbatches, round_size=sim_microbatches
            )
            host_time = host_round_time(model, work, num_gpus, sim_microbatches)
            peak = _roundpipe_peak(costs, plan)
            host = _host_bytes(model, work, plan, sim_microbatches, costs.layers.boundary_bytes)
            detail = f"plan {plan}, rounds of {sim_microbatches} microbatches"
            if host_time > sim_time:
                detail += (
                    f", host-memory bound ({sim_time:.2f} s simulated, {host_time:.2f} s host)"
                )
                sim_time = host_time
            extra = {"max_seq_len": max_seq_len(spec, gpu, work)}
        else:
            try:
                result = simulate_baseline(name, costs, num_gpus, sim_microbatches)
            except ValueError as unsupported:
                predictions.append(
                    Prediction(name, 0.0, 0.0, 0, budget, False, None, None, None, str(unsupported))
                )
                continue
            sim_time, peak = result.iteration_time or result.makespan, max(result.peak_memory)
            host, detail, extra = None, result.detail, {}
        tokens_per_s = sim_tokens / sim_time
        fits_host = None if host is None or host_budget is None else host <= host_budget
        predictions.append(
            Prediction(
                schedule=name,
                tokens_per_s=tokens_per_s,
                iteration_time=work.batch * work.seq_len / tokens_per_s,
                gpu_memory=peak,
                gpu_budget=budget,
                fits=peak <= budget,
                host_ram=host,
                host_ram_budget=None if host is None else host_budget,
                host_ram_fits=fits_host,
                detail=detail,
                **extra,
            )
        )
    return predictions


def roundpipe_plan(costs: CostModel, gpu: Gpu, num_gpus: int, sim_microbatches: int) -> Plan:
    """The automatic plan, unrefined, for rounds of ``sim_microbatches``."""
    budget = int(gpu.memory_bytes * MEMORY_HEADROOM)
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


def max_seq_len(spec: ModelSpec, gpu: Gpu, work: Workload) -> int:
    """The longest sequence that trains at batch 1 with one layer per stage (the plan that
    needs least memory: each layer recomputed alone), to the nearest 256 tokens."""
    budget = gpu.memory_bytes * MEMORY_HEADROOM
    probe = Workload(**{**work.__dict__, "batch": 1, "microbatch_size": 1})

    def fits(seq_len: int) -> bool:
        model = _Model.build(spec, gpu, Workload(**{**probe.__dict__, "seq_len": seq_len}), seq_len)
        return _finest_plan_peak(model) <= budget

    low, high = 0, 256
    while fits(high) and high < 2**24:
        low, high = high, high * 2
    while high - low > 256:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _finest_plan_peak(model: _Model) -> int:
    """Peak device bytes with one unit per stage: the running stage's weights, gradients
    and activations, and the next stage's weights (prefetched)."""
    ratio = model.trainable * HALF / model.upload_bytes
    prefetched = max(u.param_bytes for u in model.units)
    return max(u.param_bytes * (1 + ratio) + u.activation_bytes + prefetched for u in model.units)


def _roundpipe_peak(costs: CostModel, plan) -> int:
    """Peak device bytes of the plan: its biggest backward stage running with the next
    stage's weights prefetched (as :func:`_finest_plan_peak`, stage by stage)."""
    layers = costs.layers
    stages = [(r, False) for r in plan.forward_ranges()]
    stages += [(r, True) for r in plan.backward_ranges()]
    prefetched = max(layers.stage_param_bytes(r) for r, _ in stages)
    peaks = []
    for r, backward in stages:
        weights = layers.stage_param_bytes(r)
        if backward:
            own = weights * (1 + costs.grad_bytes_ratio) + layers.stage_activation_bytes(r)
        else:
            own = weights + max(layers.activation_bytes[i] for i in r)
        peaks.append(own + prefetched)
    return int(max(peaks))


def _host_bytes(model: _Model, work: Workload, plan, round_microbatches: int, boundary: int) -> int:
    saved_inputs = (len(plan.backward) - 1) * round_microbatches * boundary
    whole = model.trainable * (HOST_BYTES_TRAINABLE - SHARDED_HOST_BYTES)
    sharded = -(-model.trainable * SHARDED_HOST_BYTES // work.optimizer_shards)
    return whole + sharded + model.frozen * HALF + saved_inputs

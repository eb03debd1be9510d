"""A model priced for one GPU and workload: each pipeline unit's seconds and bytes
(:mod:`.unit_costs`), the simulator's :class:`CostModel` of one round, and the host
memory's time per round. :mod:`.models` predicts from these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..planning.sim.costs import CostModel, LayerCosts
from .breakdown import SHARDED_HOST_BYTES
from .gpus import PCIE_BANDWIDTH, Gpu
from .host_settings import DEFAULT_SETTINGS, LeanSettings
from .layer_kinds import SLIDING_ATTENTION, LayerShape
from .model_specs import ModelSpec
from .peft_targets import NF4_EXPERT_TYPES
from .unit_costs import HALF, Kernels, UnitCost, embedding_cost, head_cost, layer_cost

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
    step: str = "async"
    """``"async"``: steps overlap the next iteration (the automatic plan minimises the
    steady state); ``"sync"``: each batch's step waits for its last call, which then
    stands alone (the plan minimises that call's makespan)."""
    weight_bytes: int = HALF
    """Bytes of a weight in the model's dtype on the host: half precision, or 4 for an
    fp32 model (``roundpipe train``'s default on the CPU), whose masters are then its
    own weights (docs/design.md#host-memory). Only the host RAM's terms read it."""
    greedy_plan: bool = False
    """Plan by the paper's greedy rule (instant, memory not considered) instead of the
    simulated search (seconds for a large model): for questions of bytes alone, such as
    ``roundpipe train``'s memory check."""
    lora_experts: bool = True
    """LoRA adapts the routed experts where peft's ``all-linear`` does (peft 0.22 on the
    models of :mod:`.peft_targets`); False: the other linears only (the paper's runs;
    ``--lora-targets`` that name no expert projection)."""
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
class PricedModel:
    """The per-unit costs of one model, GPU and workload, and their totals."""

    spec: ModelSpec
    units: list[UnitCost]
    trainable: int
    frozen: int
    quantized: int = 0
    """Of the frozen parameters, those held and uploaded in NF4."""

    @classmethod
    def build(cls, spec: ModelSpec, gpu: Gpu, work: Workload, tokens: int) -> PricedModel:
        rank, nf4 = work.lora_rank, work.settings.quantize == "nf4"
        spec = adapted_spec(spec, work)
        kernels = Kernels(gpu, work.precision, work.mfu)
        chunk = work.seq_chunk_tokens
        costs: dict[LayerShape, UnitCost] = {}
        for shape in dict.fromkeys(spec.layer_shapes):  # each kind of layer priced once
            window = spec.sliding_window if shape.mixer == SLIDING_ATTENTION else None
            costs[shape] = layer_cost(
                spec, kernels, tokens, work.seq_len, window, rank, nf4, chunk, layer=shape
            )
        layers = [costs[shape] for shape in spec.layer_shapes]
        units = [
            embedding_cost(spec, kernels, tokens, rank > 0),
            *layers,
            head_cost(spec, kernels, tokens, rank > 0, chunk),
        ]
        trainable = spec.lora_params(rank) if rank else spec.num_params
        frozen = spec.num_params if rank else 0
        quantized = spec.total_linear_weight_params if nf4 else 0
        return cls(spec, units, trainable, frozen, quantized)

    @property
    def upload_bytes(self) -> int:
        return sum(u.param_bytes for u in self.units)


def adapted_spec(spec: ModelSpec, work: Workload) -> ModelSpec:
    """``spec`` with the routed experts' adapters as ``work`` trains them: none where
    ``work.lora_experts`` is False, nor over an NF4 base that quantizes the experts."""
    frozen_experts = work.settings.quantize == "nf4" and spec.model_type in NF4_EXPERT_TYPES
    return replace(spec, lora_experts=work.lora_experts and not frozen_experts)


def cost_model(
    model: PricedModel, gpu: Gpu, work: Workload, num_gpus: int, sim_microbatches: int
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


def host_round_time(model: PricedModel, work: Workload, num_gpus: int, round_size: int) -> float:
    """Seconds the host memory needs per round for every copy and its share of the step."""
    boundary = work.tokens_per_microbatch * model.spec.hidden_size * HALF
    hops = round_size * 2 * (2 * num_gpus) * boundary  # both ways, forward and backward
    weights = 2 * model.upload_bytes + model.trainable * (HALF + GRAD_ACCUMULATE_BYTES)
    step = model.trainable * ADAM_BYTES * round_size / work.num_microbatches
    step /= work.optimizer_shards
    return (hops + weights + step) / work.host_bandwidth

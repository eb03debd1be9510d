"""Model-level prediction: "will it fit on my box, and how fast?".

From a Hugging Face decoder config (a dict, a ``transformers`` config object, or a
named preset below; no hub downloads) plus a GPU preset, sequence length and batch,
derive per-layer FLOPs, times, bytes and activation sizes, then simulate RoundPipe
(with the automatic plan) and the weight-bound baselines to predict tokens/s,
per-GPU memory and the host RAM RoundPipe needs.

Assumptions, kept simple and stated: fp16/bf16 weights and activations; a layer's
forward costs ``2 x params`` FLOPs per token plus causal attention, backward twice
that; kernels reach ``mfu`` of the GPU's dense tensor FLOP/s; every stage-boundary
activation goes device -> host -> device over PCIe (consumer GPUs have no usable
peer links); the host Adam step streams ~28 bytes per parameter through host
memory. Baselines keep weights, gradients and fp32 Adam state on their GPUs
(Megatron-PP style).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .partition import auto_plan
from .sim.baselines import BASELINES, simulate_baseline
from .sim.costs import CostModel, Hardware, LayerCosts
from .sim.result import SimResult
from .sim.roundpipe_schedule import simulate_roundpipe

BYTES_PER_VALUE = 2  # fp16/bf16
ADAM_HOST_BYTES_PER_PARAM = 28  # read grad+master+m+v, write master+m+v+half weights
HOST_STATE_BYTES_PER_PARAM = 16  # half weights + half grads + fp32 master, m, v
DEVICE_OPTIMIZER_RATIO = 6.0  # fp32 master + m + v (12 B) per half-precision weight (2 B)
MEMORY_HEADROOM = 0.9  # the CUDA context and the allocator's fragmentation take the rest


@dataclass(frozen=True)
class ModelSpec:
    """The shape numbers of a decoder-only transformer."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Mapping | object, name: str = "custom") -> ModelSpec:
        """Read a Hugging Face config (dict or ``PretrainedConfig``)."""
        values = config.to_dict() if hasattr(config, "to_dict") else dict(config)  # type: ignore[arg-type]
        try:
            hidden, heads = values["hidden_size"], values["num_attention_heads"]
            return cls(
                name=values.get("name_or_path") or values.get("_name_or_path") or name,
                hidden_size=hidden,
                intermediate_size=values["intermediate_size"],
                num_layers=values["num_hidden_layers"],
                num_heads=heads,
                num_kv_heads=values.get("num_key_value_heads") or heads,
                head_dim=values.get("head_dim") or hidden // heads,
                vocab_size=values["vocab_size"],
            )
        except KeyError as missing:
            raise ValueError(f"the model config has no {missing} entry") from None

    @property
    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)  # q, o and k, v
        return attention + 3 * h * self.intermediate_size + 2 * h

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        # Embedding and LM head counted separately (as the pipeline holds them).
        return self.num_layers * self.layer_params + 2 * self.embedding_params + self.hidden_size


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name.lower(): spec
    for spec in (
        ModelSpec("Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, 151936),
        ModelSpec("Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936),
        ModelSpec("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256),
        ModelSpec("Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936),
    )
}


def model_preset(name: str) -> ModelSpec:
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        known = ", ".join(s.name for s in MODEL_PRESETS.values())
        raise ValueError(f"unknown model preset {name!r}; known presets: {known}") from None


@dataclass(frozen=True)
class Workload:
    """What one iteration trains on, and how fast the kernels run."""

    seq_len: int
    batch: int
    """Sequences per iteration."""
    microbatch_size: int = 1
    mfu: float = 0.6
    host_bandwidth: float = 100e9
    """Host memory bandwidth the optimizer streams at (bytes/s)."""

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
    gpu_memory: int
    """Peak bytes on the fullest GPU."""
    fits: bool
    host_ram: int | None
    detail: str

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def cost_model(spec: ModelSpec, gpu: Hardware, work: Workload) -> CostModel:
    """Per-microbatch costs of the units ``[embedding, layer 0 .. layer L-1, head+loss]``."""
    tokens, h = work.tokens_per_microbatch, spec.hidden_size
    speed = gpu.flops * work.mfu
    attention = 2 * tokens * work.seq_len * spec.num_heads * spec.head_dim  # causal: half of 4
    layer_fwd = (2 * tokens * spec.layer_params + attention) / speed
    head_fwd = 2 * tokens * spec.embedding_params / speed
    layer_act = tokens * BYTES_PER_VALUE * (10 * h + 3 * spec.intermediate_size)
    head_act = tokens * spec.vocab_size * (BYTES_PER_VALUE + 4)  # logits, fp32 for the loss
    embed_bytes = spec.embedding_params * BYTES_PER_VALUE
    n = spec.num_layers
    layers = LayerCosts(
        forward=(0.0, *[layer_fwd] * n, head_fwd),
        backward=(0.0, *[2 * layer_fwd] * n, 2 * head_fwd),
        param_bytes=(embed_bytes, *[spec.layer_params * BYTES_PER_VALUE] * n, embed_bytes),
        activation_bytes=(tokens * h * BYTES_PER_VALUE, *[layer_act] * n, head_act),
        boundary_bytes=tokens * h * BYTES_PER_VALUE,
    )
    boundary = tokens * h * BYTES_PER_VALUE
    return CostModel(
        layers=layers,
        comm=boundary / gpu.d2h_bandwidth + boundary / gpu.h2d_bandwidth,
        h2d_bandwidth=gpu.h2d_bandwidth,
        d2h_bandwidth=gpu.d2h_bandwidth,
        optimizer_time=spec.num_params * ADAM_HOST_BYTES_PER_PARAM / work.host_bandwidth,
        device_optimizer_ratio=DEVICE_OPTIMIZER_RATIO,
    )


def predict(
    spec: ModelSpec,
    gpu: Hardware,
    work: Workload,
    num_gpus: int,
    schedules: tuple[str, ...] = ("roundpipe", *BASELINES),
) -> list[Prediction]:
    """Tokens/s and memory of each schedule for this model, box and workload."""
    costs = cost_model(spec, gpu, work)
    budget = int(gpu.memory_bytes * MEMORY_HEADROOM)
    predictions = []
    for name in schedules:
        if name == "roundpipe":
            plan = auto_plan(costs, num_gpus, work.num_microbatches, [budget] * num_gpus)
            result = simulate_roundpipe(plan, costs, num_gpus, work.num_microbatches)
            host = spec.num_params * HOST_STATE_BYTES_PER_PARAM + _saved_inputs(costs, plan, work)
        else:
            try:
                result = simulate_baseline(name, costs, num_gpus, work.num_microbatches)
            except ValueError as unsupported:
                predictions.append(Prediction(name, 0.0, 0.0, 0, False, None, str(unsupported)))
                continue
            host = None
        predictions.append(_prediction(result, work, budget, host))
    return predictions


def _prediction(result: SimResult, work: Workload, budget: int, host: int | None) -> Prediction:
    time = result.iteration_time or result.makespan
    peak = max(result.peak_memory)
    return Prediction(
        schedule=result.schedule,
        tokens_per_s=work.batch * work.seq_len / time,
        iteration_time=time,
        gpu_memory=peak,
        fits=peak <= budget,
        host_ram=host,
        detail=result.detail,
    )


def _saved_inputs(costs: CostModel, plan, work: Workload) -> int:
    """Host bytes of the saved stage inputs (one per backward stage and microbatch)."""
    return (len(plan.backward) - 1) * work.num_microbatches * costs.layers.boundary_bytes

"""Seconds and device bytes of each pipeline unit (embedding, decoder layer, head), from
a model's shapes, a GPU and one microbatch of tokens.

Each term (matmuls, attention, expert GEMMs, elementwise bytes) is priced at what bounds
it on a GPU, with constants calibrated once for all models against the published
RoundPipe measurements (bench/README.md "Calibration"); the terms and what activation
bytes count are in docs/design.md#unit-costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.tiling import SINK_DIMS, TILED_LOSS_LOGITS
from .gpus import Gpu
from .host_settings import DEQUANTIZED_BYTES, NF4_BYTES, nf4_bytes
from .model_specs import ModelSpec

MATMUL_EFFICIENCY = 0.82
ATTENTION_EFFICIENCY = 0.6
MEMORY_EFFICIENCY = 0.9
ACTIVATION_FACTOR = 1.35
EXPERT_OVERHEAD = 110e-6
"""Seconds per expert and forward pass outside its GEMMs: Hugging Face's MoE layers loop
over the experts in Python (find the expert's tokens, which syncs with the host,
gather, three GEMMs, activation, weighted scatter-add); backward replays it twice."""
HEAD_BYTES_PER_LOGIT = 1.2
"""Head memory per token and vocabulary entry that grows with the sequence (calibrated
to the published maximum lengths: the paper's loss; roundpipe.hf.decoder's chunked loss
itself is bounded, :func:`tiled_head_bytes`)."""
LOSS_CHUNK_TOKENS = 4096
"""Tokens per chunk of the head's loss (``roundpipe.hf.decoder.LOSS_CHUNK_TOKENS``)."""

HALF, FP32 = 2, 4
NORM_BYTES = 36  # HF RMSNorm per element: upcast, square, mean, scale, downcast, weight
ROTARY_BYTES = 20  # x*cos + rotate_half(x)*sin
SWIGLU_BYTES = 10  # silu(gate) * up
RESIDUAL_BYTES = 6
LOSS_FORWARD_BYTES = 12  # per logit: half logits, fp32 log-softmax (calibrated: eager is ~16)
LOSS_BACKWARD_BYTES = 8  # per logit: softmax gradient, downcast (calibrated)
ATTENTION_BACKWARD = 2.5
TILED_LOSS_BYTES_PER_LOGIT = 3 * FP32
"""A loss chunk's peak in its backward: the float32 log-softmax it saved, the gradient
of the loss and of the log-softmax (measured on the emulated device)."""


@dataclass(frozen=True)
class UnitCost:
    """One unit, one microbatch: seconds, and the bytes of its weights and activations."""

    forward: float
    backward: float
    param_bytes: int
    activation_bytes: int


@dataclass(frozen=True)
class Kernels:
    """How fast a GPU runs each kind of work in one precision mode."""

    gpu: Gpu
    precision: str
    matmul_efficiency: float | None = None
    """Overrides ``MATMUL_EFFICIENCY`` (the command line's ``--mfu``)."""

    @property
    def matmul_speed(self) -> float:
        efficiency = self.matmul_efficiency or MATMUL_EFFICIENCY
        return self.gpu.matmul_flops(self.precision) * efficiency

    @property
    def attention_speed(self) -> float:
        return self.gpu.attention_flops * ATTENTION_EFFICIENCY

    @property
    def memory_speed(self) -> float:
        return self.gpu.memory_bandwidth * MEMORY_EFFICIENCY


def layer_cost(
    spec: ModelSpec,
    kernels: Kernels,
    tokens: int,
    seq_len: int,
    window: int | None,
    lora_rank: int,
    quantized: bool = False,
    seq_chunk: int | None = None,
) -> UnitCost:
    """A decoder layer: attention (full or over a sliding ``window``) and MLP or MoE;
    ``quantized``: its frozen linear weights uploaded in NF4 and dequantized on the GPU;
    ``seq_chunk``: its MLP and norms tiled in chunks of that many tokens (the memory of
    :func:`tiled_layer_bytes`, and one more forward of each chunk in the backward)."""
    frozen = lora_rank > 0
    h, q, kv = spec.hidden_size, spec.q_width, spec.kv_width
    dense_linear = h * (2 * q + 2 * kv) + 3 * h * spec.intermediate_size + spec.router_params
    adapters = spec.lora_layer_params(lora_rank)
    matmul = 2 * tokens * (dense_linear + adapters)
    matmul_backward = 2 * tokens * (dense_linear * (1 if frozen else 2) + 2 * adapters)
    attention = 4 * tokens * _context(seq_len, window) * q
    elementwise = tokens * _elementwise_bytes(spec)
    experts_fwd, experts_bwd = _expert_times(spec, kernels, tokens, frozen)
    nf4 = spec.linear_weight_params if quantized else 0
    dequantize = dequantize_time(dequantized_params(spec, tokens), kernels) if quantized else 0.0
    forward = (
        matmul / kernels.matmul_speed
        + attention / kernels.attention_speed
        + elementwise / kernels.memory_speed
        + experts_fwd
        + dequantize
    )
    # the input gradient dequantizes each weight again (roundpipe.hf.nf4 keeps the NF4
    # bytes for the backward, not the dense weight, so a dense weight lives one linear
    # at a time: a temporary like those ACTIVATION_FACTOR covers)
    backward = (
        matmul_backward / kernels.matmul_speed
        + ATTENTION_BACKWARD * attention / kernels.attention_speed
        + 2 * elementwise / kernels.memory_speed
        + experts_bwd
        + dequantize
    )
    activations = int(ACTIVATION_FACTOR * tokens * _saved_bytes(spec, frozen, lora_rank > 0))
    if seq_chunk is not None:
        activations = tiled_layer_bytes(spec, tokens, seq_chunk)
        backward += tokens * _mlp_forward_flops(spec) / kernels.matmul_speed
        if spec.sinks or window is not None:  # attention in pieces, recomputed too
            backward += attention / kernels.attention_speed
    return UnitCost(
        forward,
        backward,
        (spec.layer_params - nf4 + adapters) * HALF + nf4_bytes(nf4),
        activations,
    )


def tiled_layer_bytes(spec: ModelSpec, tokens: int, chunk: int) -> int:
    """Device bytes of a decoder layer's backward over ``tokens`` with its MLP and norms
    tiled in chunks of ``chunk`` tokens (docs/design.md#long-context), besides its
    weights and gradients: what grows with the sequence, per token, plus one chunk's
    working set. Measured on the emulated device (tests/test_long_context.py)."""
    h, q, kv = spec.hidden_size, spec.q_width, spec.kv_width
    # At the peak, the attention's backward: the saved input, the incoming gradient,
    # the first norm's output, the two residual sums, the next backward job's saved
    # input already uploaded (hidden size); the rotated queries
    # and keys, the values, the attention output and the gradients of all four (query
    # and key-value sizes); the log-sum-exp, the rotary tables; with per-head norms,
    # their inputs (kept by their tiles).
    per_token = HALF * (6 * h + 4 * q + 4 * kv) + FP32 * spec.num_heads
    per_token += 2 * HALF * spec.head_dim
    if spec.qk_norm:
        per_token += HALF * (q + kv)
    if spec.sinks:  # an example's recompute with the sink dimensions (calibrated)
        per_token += HALF * 3 * (q + kv) * (spec.head_dim + SINK_DIMS) // spec.head_dim
    # one tiled chunk's working set, counted as if beside it (an upper bound)
    return tokens * per_token + min(tokens, chunk) * _chunk_bytes_per_token(spec)


def tiled_head_bytes(spec: ModelSpec, tokens: int, chunk: int) -> int:
    """The head's backward with its norm tiled and its loss in chunks of
    ``LOSS_CHUNK_TOKENS``: the input, the normed hidden states and their gradients and
    the next job's input per token, and one loss chunk's logits."""
    h, v = spec.hidden_size, spec.vocab_size
    loss_chunk = max(1, min(tokens, LOSS_CHUNK_TOKENS, TILED_LOSS_LOGITS // v))
    norm_chunk = min(tokens, chunk) * 6 * FP32 * h
    return tokens * 5 * HALF * h + loss_chunk * v * TILED_LOSS_BYTES_PER_LOGIT + norm_chunk


def _chunk_bytes_per_token(spec: ModelSpec) -> int:
    """One tiled chunk's working set per token, the largest of: an MLP's gate, up and
    activation outputs and their gradients (the routed experts' in an MoE layer) beside
    a norm's float32 copies; the per-head norms' float32 copies."""
    width = spec.intermediate_size or spec.experts_per_token * spec.moe_intermediate_size
    mlp = 6 * HALF * width + 6 * FP32 * spec.hidden_size
    heads = 6 * FP32 * (spec.q_width + spec.kv_width) if spec.qk_norm else 0
    return max(mlp, heads)


def _mlp_forward_flops(spec: ModelSpec) -> int:
    """Matmul flops per token of the MLP's forward (the routed experts' in an MoE)."""
    width = spec.intermediate_size or spec.experts_per_token * spec.moe_intermediate_size
    return 2 * 3 * spec.hidden_size * width


def dequantized_params(spec: ModelSpec, tokens: int) -> int:
    """The NF4 weights one pass of a layer over ``tokens`` dequantizes: all but the
    experts no token is routed to (a microbatch of training reaches them all)."""
    if not spec.is_moe:
        return spec.linear_weight_params
    idle = spec.num_experts - min(spec.num_experts, tokens * spec.experts_per_token)
    return spec.linear_weight_params - idle * 3 * spec.hidden_size * spec.moe_intermediate_size


def dequantize_time(num_params: int, kernels: Kernels) -> float:
    """Seconds to dequantize ``num_params`` NF4 weights into bf16 on the GPU: a
    memory-bound pass reading the codes and scales and writing the bf16 weight."""
    return float(num_params * (NF4_BYTES + DEQUANTIZED_BYTES)) / kernels.memory_speed


def head_cost(
    spec: ModelSpec, kernels: Kernels, tokens: int, frozen: bool, seq_chunk: int | None = None
) -> UnitCost:
    """Final norm, LM head and the loss in chunks (each chunk recomputed in backward);
    ``seq_chunk``: the norm tiled too, memory as :func:`tiled_head_bytes`."""
    h, v = spec.hidden_size, spec.vocab_size
    matmul = 2 * tokens * v * h
    loss_fwd = tokens * (v * LOSS_FORWARD_BYTES + NORM_BYTES * h)
    loss_bwd = tokens * v * (LOSS_FORWARD_BYTES + LOSS_BACKWARD_BYTES) + 2 * tokens * NORM_BYTES * h
    forward = matmul / kernels.matmul_speed + loss_fwd / kernels.memory_speed
    backward = (1 + (1 if frozen else 2)) * matmul / kernels.matmul_speed
    backward += loss_bwd / kernels.memory_speed
    chunk = min(tokens, LOSS_CHUNK_TOKENS)
    working = chunk * v * (LOSS_FORWARD_BYTES + LOSS_BACKWARD_BYTES) // 2
    saved = tokens * ((2 * HALF + FP32) * h + HEAD_BYTES_PER_LOGIT * v)
    memory = int(saved + working)
    if seq_chunk is not None:
        memory = tiled_head_bytes(spec, tokens, seq_chunk)
    return UnitCost(forward, backward, spec.embedding_params * HALF, memory)


def embedding_cost(spec: ModelSpec, kernels: Kernels, tokens: int, frozen: bool) -> UnitCost:
    """The lookup, and (trained) the dense gradient of the table it scatters into."""
    h = spec.hidden_size
    forward = 2 * HALF * tokens * h / kernels.memory_speed
    backward = 0.0 if frozen else (spec.embedding_params + 2 * tokens * h) * HALF
    return UnitCost(
        forward,
        backward / kernels.memory_speed,
        spec.embedding_params * HALF,
        tokens * h * HALF,
    )


def _context(seq_len: int, window: int | None) -> float:
    """Average number of keys a query attends to (causal, maybe windowed)."""
    full = (seq_len + 1) / 2
    if window is None or window >= seq_len:
        return full
    return window * (1 - window / (2 * seq_len))


def _elementwise_bytes(spec: ModelSpec) -> int:
    """Forward bytes read and written per token by the layer's memory-bound ops."""
    h, q, kv = spec.hidden_size, spec.q_width, spec.kv_width
    norms = NORM_BYTES * (2 * h + (q + kv if spec.qk_norm else 0))
    attention = ROTARY_BYTES * (q + kv) + 2 * HALF * (2 * q + 2 * kv)  # rotary, layout copies
    residuals = 2 * RESIDUAL_BYTES * h
    if not spec.is_moe:
        return norms + attention + residuals + SWIGLU_BYTES * spec.intermediate_size
    k = spec.experts_per_token
    routing = 3 * FP32 * spec.num_experts  # router softmax and top-k
    gather_combine = k * (2 * HALF * h + 2 * FP32 * h)  # copy inputs in, weighted sum out
    experts = k * SWIGLU_BYTES * spec.moe_intermediate_size
    return norms + attention + residuals + routing + gather_combine + experts


def _expert_times(
    spec: ModelSpec, kernels: Kernels, tokens: int, frozen: bool
) -> tuple[float, float]:
    """Forward and backward seconds of an MoE layer's expert GEMMs (0 for a dense layer)."""
    if not spec.is_moe:
        return 0.0, 0.0
    routed = tokens * spec.experts_per_token
    used = min(spec.num_experts, routed)
    params = spec.expert_params
    flops = 2 * routed * params  # all experts together
    weights = used * params * HALF / kernels.memory_speed
    overhead = used * EXPERT_OVERHEAD
    forward = flops / kernels.matmul_speed + weights + overhead
    if frozen:  # input gradient only: read the weights once more
        return forward, forward + overhead
    # input and weight gradients: read the weights, write their gradients
    return forward, 2 * flops / kernels.matmul_speed + 2 * weights + 2 * overhead


def _saved_bytes(spec: ModelSpec, frozen: bool, adapted: bool) -> int:
    """Bytes per token a layer keeps for its backward, plus its backward's gradients."""
    h, q, kv = spec.hidden_size, spec.q_width, spec.kv_width
    attention_inputs = (not frozen) or adapted  # q/k/v/o save their inputs
    mlp_inputs = (not frozen) or (adapted and not spec.is_moe)
    # each norm keeps its fp32 input, and its output where a linear saves it as input
    norms = 2 * FP32 * h + HALF * h * (attention_inputs + (mlp_inputs or not frozen))
    if spec.qk_norm:
        norms += (FP32 + HALF) * (q + kv)
    attention = HALF * (2 * q + 2 * kv) + (HALF * q if attention_inputs else 0)
    attention_grads = HALF * (2 * q + 2 * kv)
    if not spec.is_moe:
        i = spec.intermediate_size
        mlp = HALF * 3 * i + (HALF * i if mlp_inputs else 0)
        grads = max(attention_grads, HALF * 3 * i)
        return norms + attention + mlp + grads + HALF * h
    k, i = spec.experts_per_token, spec.moe_intermediate_size
    per_expert_token = HALF * 3 * i + HALF * h + (HALF * (i + h) if mlp_inputs else 0)
    routing = FP32 * spec.num_experts
    # backward runs the experts one after another: one expert's gradients at a time
    grads = max(attention_grads, k * HALF * h)
    return norms + attention + routing + k * per_expert_token + grads + HALF * h

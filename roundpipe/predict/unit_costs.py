"""Seconds and device bytes of each pipeline unit (embedding, decoder layer, head), from
a model's shapes, a GPU and one microbatch of tokens.

Each term (matmuls, attention, expert GEMMs, elementwise bytes) is priced at what bounds
it on a GPU, with constants calibrated once for all models against the published
RoundPipe measurements (bench/README.md "Calibration"); the terms and what activation
bytes count are in docs/design.md#unit-costs. A layer is priced by its kind
(:class:`~.layer_kinds.LayerShape`): the Llama-like kinds (attention, dense MLP, MoE)
are the calibrated ones; MLA, gated attention, shared experts, Gated DeltaNet and
Mamba2 are priced by the same rules with first-order counts (:mod:`.mixers`,
:mod:`.recurrent_mixers`, :mod:`.layer_terms`): estimates, not calibrated on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.tiling import TILED_LOSS_LOGITS
from .gpus import Gpu
from .host_settings import DEQUANTIZED_BYTES, NF4_BYTES, nf4_bytes
from .layer_kinds import MOE, LayerShape
from .layer_terms import (
    default_layer,
    elementwise_bytes,
    mlp_forward_flops,
    saved_bytes,
    tiled_layer_bytes,
)
from .model_shape import ModelSpec
from .op_bytes import FP32, HALF, NORM_BYTES

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
    layer: LayerShape | None = None,
) -> UnitCost:
    """A decoder layer of kind ``layer`` (default: attention, full or over a sliding
    ``window``, and the model's MLP or MoE block): its mixer and feed-forward block;
    ``quantized``: its frozen linear weights uploaded in NF4 and dequantized on the GPU;
    ``seq_chunk``: its MLP and norms tiled in chunks of that many tokens (the memory of
    :func:`tiled_layer_bytes`, and one more forward of each chunk in the backward)."""
    shape = layer or default_layer(spec, window)
    mixer = spec.mixer(shape.mixer)
    frozen = lora_rank > 0
    dense_linear = spec.dense_linear_params(shape)
    adapters = spec.lora_params_of(shape, lora_rank)
    on_experts = spec.expert_adapter_params(shape, lora_rank)
    folded = on_experts > 0  # folded into the experts' weights, which then train
    per_token = adapters - on_experts
    matmul = 2 * tokens * (dense_linear + per_token)
    matmul_backward = 2 * tokens * (dense_linear * (1 if frozen else 2) + 2 * per_token)
    attention = mixer.sequence_flops(tokens, seq_len, window)
    elementwise = tokens * elementwise_bytes(spec, shape)
    experts_fwd, experts_bwd = _expert_times(spec, kernels, tokens, frozen and not folded, shape)
    folded_fwd, folded_bwd, folded_bytes = (
        _folded_expert_adapters(spec, kernels, lora_rank) if folded else (0.0, 0.0, 0)
    )
    experts_fwd, experts_bwd = experts_fwd + folded_fwd, experts_bwd + folded_bwd
    nf4 = spec.linear_weights_of(shape) if quantized else 0
    dequantize = 0.0
    if quantized:
        dequantize = dequantize_time(dequantized_params(spec, tokens, shape), kernels)
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
    activations = int(ACTIVATION_FACTOR * tokens * saved_bytes(spec, shape, frozen, frozen))
    if seq_chunk is not None:
        activations = tiled_layer_bytes(spec, tokens, seq_chunk, shape)
        backward += tokens * mlp_forward_flops(spec, shape) / kernels.matmul_speed
        if mixer.attends and (mixer.sinks or window is not None):  # attention in pieces
            backward += attention / kernels.attention_speed  # recomputed too
    activations += folded_bytes
    return UnitCost(
        forward,
        backward,
        (spec.layer_params_of(shape) - nf4 + adapters) * HALF + nf4_bytes(nf4),
        activations,
    )


def tiled_head_bytes(spec: ModelSpec, tokens: int, chunk: int) -> int:
    """The head's backward with its norm tiled and its loss in chunks of
    ``LOSS_CHUNK_TOKENS``: the input, the normed hidden states and their gradients and
    the next job's input per token, and one loss chunk's logits."""
    h, v = spec.hidden_size, spec.vocab_size
    loss_chunk = max(1, min(tokens, LOSS_CHUNK_TOKENS, TILED_LOSS_LOGITS // v))
    norm_chunk = min(tokens, chunk) * 6 * FP32 * h
    return tokens * 5 * HALF * h + loss_chunk * v * TILED_LOSS_BYTES_PER_LOGIT + norm_chunk


def dequantized_params(spec: ModelSpec, tokens: int, layer: LayerShape | None = None) -> int:
    """The NF4 weights one pass of a layer (default: the largest) over ``tokens``
    dequantizes: all but the routed experts no token is routed to (a microbatch of
    training reaches them all)."""
    if layer is None:
        shapes = dict.fromkeys(spec.layer_shapes)
        layer = max(shapes, key=spec.linear_weights_of)
    weights = spec.linear_weights_of(layer)
    if layer.ffn != MOE:
        return weights
    idle = spec.num_experts - min(spec.num_experts, tokens * spec.experts_per_token)
    matrices = 3 if spec.mlp_gated else 2
    return weights - idle * matrices * spec.hidden_size * spec.moe_intermediate_size


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


def _expert_times(
    spec: ModelSpec, kernels: Kernels, tokens: int, frozen: bool, layer: LayerShape
) -> tuple[float, float]:
    """Forward and backward seconds of an MoE layer's routed expert GEMMs (0 for a
    dense layer; shared experts are dense matmuls over every token)."""
    if layer.ffn != MOE:
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


def _folded_expert_adapters(
    spec: ModelSpec, kernels: Kernels, rank: int
) -> tuple[float, float, int]:
    """peft's adapters on a layer's routed experts (``ModelSpec.expert_adapters``): each
    forward folds them into the stacked weights, ``W + B A`` per projection for every
    expert (one ``baddbmm``: a new stack as large as the experts' weights, which their
    GEMMs save for the backward); the backward forms that stack's gradient (the experts'
    weight gradient, priced by :func:`_expert_times` as in a full fine-tune) and the
    factors' gradients from it. Seconds of the fold and of the factors' gradients, and the
    bytes of the two stacks (the folded weights and their gradient)."""
    h, i, experts = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    up = 2 if spec.mlp_gated else 1  # gate_up_proj's adapter has up x the rank
    fold = 2 * experts * h * i * (up * up * rank + rank)
    stack = experts * spec.expert_params * HALF
    fold_time = fold / kernels.matmul_speed + 2 * stack / kernels.memory_speed
    backward = 2 * fold / kernels.matmul_speed + stack / kernels.memory_speed
    return fold_time, backward, 2 * stack

"""Per-token byte counts of one decoder layer, layer kind by layer kind: what its
memory-bound ops move, what autograd keeps for its backward, and the tiled
long-context law (docs/design.md#unit-costs, docs/design.md#long-context).

A layer is its token mixer (:mod:`.mixers`, :mod:`.recurrent_mixers`: each counts its
own terms) and its feed-forward block (a dense MLP, or routed and shared experts),
with the layer's norms and residual sums around them. For a Llama-like layer these
are the calibrated counts of the paper's models; for the other kinds they follow the
same rules, estimates not calibrated on a GPU.
"""

from __future__ import annotations

from .layer_kinds import DENSE, FULL_ATTENTION, MOE, NO_MIXER, SLIDING_ATTENTION, LayerShape
from .model_shape import ModelSpec
from .op_bytes import FP32, HALF, NORM_BYTES, RESIDUAL_BYTES, SWIGLU_BYTES


def default_layer(spec: ModelSpec, window: int | None) -> LayerShape:
    """The layer a caller names by its window only: attention (sliding with a window)
    and the model's MLP or MoE block."""
    mixer = SLIDING_ATTENTION if window is not None else FULL_ATTENTION
    return LayerShape(mixer, MOE if spec.is_moe else DENSE)


def ffn_width(spec: ModelSpec, layer: LayerShape) -> int:
    """The MLP width a token runs through: the dense MLP's, or its routed experts' and
    the shared experts' together."""
    if layer.ffn == DENSE:
        return spec.intermediate_size
    if layer.ffn == MOE:
        return spec.experts_per_token * spec.moe_intermediate_size + spec.shared_width
    return 0


def mlp_forward_flops(spec: ModelSpec, layer: LayerShape) -> int:
    """Matmul flops per token of the MLP's forward (the routed and shared experts' in an
    MoE layer)."""
    matrices = 3 if spec.mlp_gated else 2
    return 2 * matrices * spec.hidden_size * ffn_width(spec, layer)


def elementwise_bytes(spec: ModelSpec, layer: LayerShape) -> int:
    """Forward bytes read and written per token by the layer's memory-bound ops."""
    h = spec.hidden_size
    norms = NORM_BYTES * spec.norms_per_layer * h
    residuals = layer.sublayers * RESIDUAL_BYTES * h
    total = norms + spec.mixer(layer.mixer).elementwise_bytes + residuals
    if layer.ffn == DENSE:
        return total + SWIGLU_BYTES * spec.intermediate_size
    if layer.ffn != MOE:
        return total
    k = spec.experts_per_token
    routing = 3 * FP32 * spec.num_experts  # router softmax and top-k
    gather_combine = k * (2 * HALF * h + 2 * FP32 * h)  # copy inputs in, weighted sum out
    experts = k * SWIGLU_BYTES * spec.moe_intermediate_size
    shared = 0
    if spec.shared_width:  # its activation, its gate, added to the routed experts' sum
        shared = SWIGLU_BYTES * spec.shared_width + RESIDUAL_BYTES * h
        shared += SWIGLU_BYTES * h if spec.shared_expert_gate else 0
    return total + routing + gather_combine + experts + shared


def saved_bytes(spec: ModelSpec, layer: LayerShape, frozen: bool, adapted: bool) -> int:
    """Bytes per token a layer keeps for its backward, plus its backward's gradients."""
    h, mixer = spec.hidden_size, spec.mixer(layer.mixer)
    matrices = 3 if spec.mlp_gated else 2
    mixer_inputs = (not frozen) or adapted  # its projections save their inputs
    dense_inputs = (not frozen) or (adapted and layer.ffn == DENSE)
    shared_inputs = (not frozen) or adapted
    ffn_inputs = dense_inputs or (layer.ffn == MOE and spec.shared_width > 0 and shared_inputs)
    # each norm keeps its fp32 input, and its output where a linear saves it as input
    norms = spec.norms_per_layer * FP32 * h
    if layer.mixer != NO_MIXER:
        norms += HALF * h * mixer_inputs
    if layer.ffn in (DENSE, MOE):
        norms += HALF * h * (ffn_inputs or not frozen)
    saved, grads = mixer.saved_bytes(mixer_inputs), mixer.grad_bytes
    if layer.ffn == DENSE:
        i = spec.intermediate_size
        saved += HALF * matrices * i + (HALF * i if dense_inputs else 0)
        grads = max(grads, HALF * matrices * i)
    elif layer.ffn == MOE:
        k, i = spec.experts_per_token, spec.moe_intermediate_size
        expert_inputs = not frozen  # the routed experts keep no adapters
        per_expert_token = HALF * matrices * i + HALF * h
        per_expert_token += HALF * (i + h) if expert_inputs else 0
        saved += FP32 * spec.num_experts + k * per_expert_token  # routing
        # backward runs the experts one after another: one expert's gradients at a time
        grads = max(grads, k * HALF * h)
        if spec.shared_width:
            ws = spec.shared_width
            saved += HALF * matrices * ws + (HALF * ws if shared_inputs else 0)
            grads = max(grads, HALF * matrices * ws)
    return norms + saved + grads + HALF * h


def chunk_bytes_per_token(spec: ModelSpec, layer: LayerShape) -> int:
    """One tiled chunk's working set per token, the largest of: an MLP's gate, up and
    activation outputs and their gradients (the routed and shared experts' in an MoE
    layer) beside a norm's float32 copies; the per-head norms' float32 copies."""
    matrices = 3 if spec.mlp_gated else 2
    mlp = 2 * matrices * HALF * ffn_width(spec, layer) + 6 * FP32 * spec.hidden_size
    heads = 6 * FP32 * spec.mixer(layer.mixer).norm_widths
    return max(mlp, heads)


def tiled_layer_bytes(
    spec: ModelSpec, tokens: int, chunk: int, layer: LayerShape | None = None
) -> int:
    """Device bytes of a decoder layer's backward over ``tokens`` with its MLP and norms
    tiled in chunks of ``chunk`` tokens (docs/design.md#long-context), besides its
    weights and gradients: what grows with the sequence, per token, plus one chunk's
    working set. Measured on the emulated device for attention layers
    (tests/hf/test_long_context.py).

    At the peak (the mixer's backward): the saved input, the incoming gradient, the
    first norm's output, the two residual sums, the next backward job's saved input
    already uploaded (hidden size), and the mixer's own tensors (:attr:`.Mixer.tiled_bytes`:
    for attention its queries, keys, values, output, their gradients, the
    log-sum-exp and the rotary tables). A Gated DeltaNet or Mamba2 mixer's tensors,
    chunk states included, are a constant per token: its law is linear in the
    sequence, with no window or ``S x S`` term (an estimate, not measured)."""
    shape = layer or default_layer(spec, None)
    per_token = HALF * 6 * spec.hidden_size + spec.mixer(shape.mixer).tiled_bytes
    # one tiled chunk's working set, counted as if beside it (an upper bound)
    return tokens * per_token + min(tokens, chunk) * chunk_bytes_per_token(spec, shape)

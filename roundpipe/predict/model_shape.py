"""The shape of a decoder-only transformer, and the parameter counts that follow from it.

:class:`ModelSpec` holds the shape numbers of a Hugging Face config: a Llama-like
model's (hidden size, MLP width, heads, vocabulary, mixture of experts, sliding
windows) and, for the other layer kinds, multi-head latent attention (MLA), shared
experts and dense-first MoE stacks, Gated DeltaNet and Mamba2 mixers in hybrid
stacks. Each layer is a :class:`~.layer_kinds.LayerShape` (its token mixer and its
feed-forward block): ``layer_shapes`` lists them, and every count is summed layer by
layer. Which counts decide memory, uploads and compute, and where LoRA adapters sit:
docs/design.md#model-shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import cast

from .config_reader import architecture, spec_fields
from .layer_kinds import (
    ATTENTION_MAMBA,
    DENSE,
    FFNS,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    MIXERS,
    MOE,
    NO_FFN,
    SLIDING_ATTENTION,
    LayerShape,
    alternating_windows,
    check_kinds,
    dense_first,
)
from .mixers import Attention, LatentAttention, Linears, Mixer
from .peft_targets import adapts_routed_experts
from .recurrent_mixers import GatedDeltaNet, Mamba2, Parallel


@dataclass(frozen=True)
class ModelSpec:
    """The shape numbers of a decoder-only transformer. The fields after
    ``sinks`` describe the layer kinds beyond Llama's; their defaults leave a
    Llama-like model as it is."""

    name: str
    hidden_size: int
    intermediate_size: int
    """The dense MLP's width (0 in an all-MoE model)."""
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    sliding_window: int | None = None
    window_layers: int = 0
    """How many layers use the sliding window (the rest attend to the whole sequence)."""
    qk_norm: bool = False
    """RMSNorm on every query and key head (Qwen3)."""
    biases: bool = False
    """Biases on every projection, attention sinks (gpt-oss)."""
    sinks: bool = False
    """A learned sink logit per attention head (gpt-oss): its attention runs through
    ``roundpipe.hf.attention``'s sink path."""
    tiled_layers: bool = True
    """``roundpipe.from_hf`` tiles its layers for long sequences (its ``model_type`` is in
    ``core.tiling.TILED_MODEL_TYPES``); the others' longest sequence is the untiled law's."""
    layer_types: tuple[str, ...] = ()
    """Each layer's token mixer (``layer_kinds.MIXERS``); empty: ``window_layers``
    sliding layers, alternating from the first, the rest full attention."""
    ffn_types: tuple[str, ...] = ()
    """Each layer's feed-forward block (``layer_kinds.FFNS``); empty: an MoE model's
    layers MoE but the first ``first_k_dense_replace``, a dense model's dense."""
    first_k_dense_replace: int = 0
    """The first layers of an MoE model that have a dense MLP of ``intermediate_size``."""
    n_shared_experts: int = 0
    """Experts every token runs besides its routed ones (DeepSeek, GLM-4.5: one MLP of
    ``n_shared_experts`` x ``moe_intermediate_size``)."""
    shared_expert_intermediate_size: int = 0
    """The shared expert's width where the config gives it (Qwen2-MoE, Qwen3-Next,
    Qwen3.5-MoE, Nemotron-H)."""
    shared_expert_gate: bool = False
    """A sigmoid gate (hidden x 1) on the shared expert's output (Qwen)."""
    mlp_gated: bool = True
    """Gate, up and down projections (SwiGLU, GeGLU); else up and down (relu^2)."""
    fused_projections: bool = False
    """One qkv_proj and one gate_up_proj (Phi-3): LoRA adapts each as one linear."""
    norms_per_layer: int = 2
    """Hidden-size norms per layer (Gemma's sandwich norms: 4; Nemotron-H: 1)."""
    attention_bias: bool = False
    """Biases on q, k, v and o."""
    qkv_bias: bool = False
    """Biases on q, k and v (Qwen2, GLM-4.5)."""
    attention_output_gate: bool = False
    """q projects to twice its width, half a sigmoid gate on the output (Qwen3-Next)."""
    global_head_dim: int = 0
    """Full-attention layers' head size where it differs (Gemma 4)."""
    global_kv_heads: int = 0
    """Full-attention layers' key-value heads where they differ (Gemma 4)."""
    attention_k_eq_v: bool = False
    """Full-attention layers use their keys as values: no v projection (Gemma 4)."""
    q_lora_rank: int = 0
    """MLA's query latent (0: a full-rank q projection)."""
    kv_lora_rank: int = 0
    """MLA's key-value latent; non-zero makes the attention layers MLA."""
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    linear_num_key_heads: int = 0
    """Gated DeltaNet (``linear_attention`` layers): key heads."""
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    linear_fused_inputs: bool = False
    """Qwen3-Next's fused in_proj_qkvz and in_proj_ba (Qwen3.5 splits them)."""
    mamba_n_heads: int = 0
    """Mamba2 (``mamba`` layers): heads."""
    mamba_d_head: int = 0
    """Mamba2's head size (0: ``mamba_expand`` x hidden / heads)."""
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_norm: bool = True
    """A gated RMSNorm on Mamba2's output (Falcon-H1's ``mamba_rms_norm``)."""
    model_type: str = ""
    """The config's ``model_type`` (the outer one of a vision-language model): whether
    LoRA adapts its routed experts (:mod:`.peft_targets`)."""
    lora_experts: bool = True
    """LoRA adapts the routed experts where peft's ``all-linear`` does; False: the
    run's targets leave them (``Workload.lora_experts``)."""

    def __post_init__(self) -> None:
        check_kinds(self.layer_types, MIXERS, "layer (token mixer)", self.num_layers)
        check_kinds(self.ffn_types, FFNS, "feed-forward", self.num_layers)
        kinds = set(self.layer_types)
        if LINEAR_ATTENTION in kinds and not (
            self.linear_num_value_heads and self.linear_key_head_dim and self.linear_value_head_dim
        ):
            raise ValueError(
                "linear_attention layers need the Gated DeltaNet fields linear_num_key_heads, "
                "linear_num_value_heads, linear_key_head_dim and linear_value_head_dim"
            )
        if kinds & {MAMBA, ATTENTION_MAMBA} and not (self.mamba_n_heads and self.mamba_d_state):
            raise ValueError("mamba layers need mamba_n_heads and mamba_d_state")

    @classmethod
    def from_config(cls, config: Mapping | object, name: str | None = None) -> ModelSpec:
        """Read a Hugging Face config (dict or ``PretrainedConfig``), named by its
        ``_name_or_path``, else ``name``, else its architecture and size
        ("Qwen3ForCausalLM 1.7B"): a saved config.json has no ``_name_or_path``.
        Which fields are read, and what is refused: :func:`.config_reader.spec_fields`
        (a vision-language config is read from its ``text_config``; the vision tower
        is not counted)."""
        values = config.to_dict() if hasattr(config, "to_dict") else dict(cast(Mapping, config))
        spec = cls(name="", **spec_fields(values))
        given = values.get("name_or_path") or values.get("_name_or_path") or name
        return replace(spec, name=given or f"{architecture(values)} {_size(spec.num_params)}")

    @property
    def layer_shapes(self) -> tuple[LayerShape, ...]:
        mixers = self.layer_types or alternating_windows(self.num_layers, self.window_layers)
        ffns = self.ffn_types or dense_first(
            self.num_layers, self.is_moe, self.first_k_dense_replace
        )
        return tuple(LayerShape(m, f) for m, f in zip(mixers, ffns, strict=True))

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def mixer(self, kind: str) -> Mixer:
        """The token mixer of a layer of ``kind`` (``layer_kinds.MIXERS``)."""
        if kind == LINEAR_ATTENTION:
            return GatedDeltaNet(
                self.hidden_size,
                self.linear_num_key_heads,
                self.linear_num_value_heads,
                self.linear_key_head_dim,
                self.linear_value_head_dim,
                self.linear_conv_kernel_dim,
                fused_inputs=self.linear_fused_inputs,
            )
        if kind == MAMBA:
            return self._mamba()
        if kind == ATTENTION_MAMBA:
            return Parallel(self._attention(global_layer=False), self._mamba())
        if kind in (FULL_ATTENTION, SLIDING_ATTENTION):
            return self._attention(global_layer=kind == FULL_ATTENTION)
        return Mixer()

    def _attention(self, global_layer: bool) -> Mixer:
        if self.kv_lora_rank:
            return LatentAttention(
                self.hidden_size,
                self.num_heads,
                self.q_lora_rank,
                self.kv_lora_rank,
                self.qk_rope_head_dim,
                self.qk_nope_head_dim,
                self.v_head_dim,
            )
        wide = global_layer and bool(self.global_head_dim)
        return Attention(
            self.hidden_size,
            self.num_heads,
            (self.global_kv_heads or self.num_kv_heads) if wide else self.num_kv_heads,
            self.global_head_dim if wide else self.head_dim,
            qk_norm=self.qk_norm,
            biases=self.biases,
            attention_bias=self.attention_bias,
            qkv_bias=self.qkv_bias,
            sinks=self.sinks,
            output_gate=self.attention_output_gate,
            k_eq_v=wide and self.attention_k_eq_v,
        )

    def _mamba(self) -> Mamba2:
        d_head = self.mamba_d_head or self.mamba_expand * self.hidden_size // self.mamba_n_heads
        return Mamba2(
            self.hidden_size,
            self.mamba_n_heads,
            d_head,
            self.mamba_d_state,
            self.mamba_n_groups,
            self.mamba_d_conv,
            self.mamba_chunk_size,
            self.mamba_conv_bias,
            self.mamba_norm,
        )

    @property
    def attention_params(self) -> int:
        """q, k, v, o projections (+ biases and sinks, + q/k norm weights) of a
        full-attention layer."""
        return self.mixer(FULL_ATTENTION).params

    @property
    def expert_params(self) -> int:
        """One expert (or the dense MLP): gate, up and down projections."""
        h, i = self.hidden_size, self.moe_intermediate_size or self.intermediate_size
        return self._matrices * h * i + (2 * i + h if self.biases else 0)

    @property
    def _matrices(self) -> int:
        return 3 if self.mlp_gated else 2

    @property
    def shared_width(self) -> int:
        """The shared experts' MLP width (0 without)."""
        return self.shared_expert_intermediate_size or (
            self.n_shared_experts * self.moe_intermediate_size
        )

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts + (self.num_experts if self.biases else 0)

    @property
    def _shared_params(self) -> int:
        gate = self.hidden_size if self.shared_expert_gate and self.shared_width else 0
        return self._matrices * self.hidden_size * self.shared_width + gate

    def dense_linear_params(self, layer: LayerShape) -> int:
        """Weights a layer's matmuls run over every token: the mixer's projections, a
        dense MLP, an MoE layer's router and shared experts (not its routed experts)."""
        total = self.mixer(layer.mixer).linear_params
        if layer.ffn == DENSE:
            return total + self._matrices * self.hidden_size * self.intermediate_size
        if layer.ffn == MOE:
            return total + self._shared_params + self.router_params
        return total

    def _ffn_params(self, layer: LayerShape, routed: int) -> int:
        if layer.ffn == DENSE:
            return self._matrices * self.hidden_size * self.intermediate_size
        if layer.ffn == NO_FFN:
            return 0
        return routed * self.expert_params + self.router_params + self._shared_params

    def layer_params_of(self, layer: LayerShape) -> int:
        """Every parameter of one layer of this shape (all experts)."""
        mixer, norms = self.mixer(layer.mixer).params, self.norms_per_layer * self.hidden_size
        return mixer + self._ffn_params(layer, self.num_experts) + norms

    def active_params_of(self, layer: LayerShape) -> int:
        """The parameters one token computes with: the mixer, the router, the shared
        experts and its top-k routed ones."""
        mixer, norms = self.mixer(layer.mixer).params, self.norms_per_layer * self.hidden_size
        return mixer + self._ffn_params(layer, self.experts_per_token) + norms

    def linear_weights_of(self, layer: LayerShape) -> int:
        """One layer's linear weights, what NF4 quantizes: the mixer's projections and
        the MLP's (every routed and shared expert's in an MoE layer); biases, norms,
        convolutions and the router stay in the model dtype."""
        h, matrices = self.hidden_size, self._matrices
        mlp = 0
        if layer.ffn == DENSE:
            mlp = matrices * h * self.intermediate_size
        elif layer.ffn == MOE:
            mlp = self.num_experts * matrices * h * self.moe_intermediate_size
            mlp += matrices * h * self.shared_width
        return self.mixer(layer.mixer).linear_params + mlp

    def adapted_linears(self, layer: LayerShape) -> Linears:
        """The linear layers LoRA adapts (PEFT's ``all-linear``): the mixer's
        projections, a dense MLP's, the shared experts' and their gate (the routed
        experts' stacked weights: :meth:`expert_adapter_params`)."""
        h, mixer = self.hidden_size, self.mixer(layer.mixer)
        width = self.intermediate_size if layer.ffn == DENSE else 0
        gate = []
        if layer.ffn == MOE:
            width = self.shared_width
            gate = [(h, 1)] if self.shared_expert_gate and width else []
        mlp = [(h, width), (h, width), (width, h)] if width else []
        if width and not self.mlp_gated:
            mlp = mlp[1:]
        if not self.fused_projections:
            return (*mixer.adapted, *mlp, *gate)
        # Phi-3's one qkv_proj and one gate_up_proj: an adapter each
        q, kv, o = mixer.adapted[0], mixer.adapted[1:-1], mixer.adapted[-1]
        qkv = (h, q[1] + sum(out for _, out in kv))
        mlp = [(h, 2 * width), (width, h)] if width else []
        return (qkv, o, *mlp, *gate)

    @property
    def expert_adapters(self) -> bool:
        """LoRA adapts the routed experts too (peft 0.22 on a model transformers v5
        stacked the experts of: :mod:`.peft_targets`)."""
        return self.is_moe and self.lora_experts and adapts_routed_experts(self.model_type)

    def expert_adapter_params(self, layer: LayerShape, rank: int) -> int:
        """The adapters on a layer's routed experts and router (0 where LoRA leaves
        them): each expert's fused gate_up_proj at twice the rank, its down_proj, and
        the router's weight."""
        if layer.ffn != MOE or not self.expert_adapters:
            return 0
        h, i, experts = self.hidden_size, self.moe_intermediate_size, self.num_experts
        up = 2 * rank * (h + 2 * i) if self.mlp_gated else rank * (h + i)
        return experts * (up + rank * (i + h)) + rank * (h + experts)

    def lora_params_of(self, layer: LayerShape, rank: int) -> int:
        """Adapter parameters of one layer: rank x (in + out) per adapted linear, and
        the routed experts' where LoRA adapts them."""
        linears = rank * sum(a + b for a, b in self.adapted_linears(layer))
        return linears + self.expert_adapter_params(layer, rank)

    def _largest(self, count) -> int:
        return max(count(shape) for shape in dict.fromkeys(self.layer_shapes))

    @property
    def layer_params(self) -> int:
        """Every parameter of one decoder layer (all experts; the largest layer of a
        model whose layers differ)."""
        return self._largest(self.layer_params_of)

    @property
    def active_layer_params(self) -> int:
        """The parameters one token computes with in one layer (the largest layer's)."""
        return self._largest(self.active_params_of)

    @property
    def linear_weight_params(self) -> int:
        """One decoder layer's linear weights (the largest layer's), what NF4 quantizes."""
        return self._largest(self.linear_weights_of)

    @property
    def total_linear_weight_params(self) -> int:
        return sum(self.linear_weights_of(shape) for shape in self.layer_shapes)

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Unique parameters (a tied embedding once), the final norm included."""
        layers = sum(self.layer_params_of(shape) for shape in self.layer_shapes)
        embeddings = self.embedding_params * (1 if self.tie_word_embeddings else 2)
        return layers + embeddings + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters a token computes with: layers' active ones and the LM head."""
        layers = sum(self.active_params_of(shape) for shape in self.layer_shapes)
        return layers + self.embedding_params

    @property
    def upload_params(self) -> int:
        """Parameters uploaded per pass over the pipeline (a tied embedding at both ends)."""
        layers = sum(self.layer_params_of(shape) for shape in self.layer_shapes)
        return layers + 2 * self.embedding_params + self.hidden_size

    def lora_layer_params(self, rank: int) -> int:
        """Adapter parameters of one layer (the largest layer's)."""
        return self._largest(lambda shape: self.lora_params_of(shape, rank))

    def lora_params(self, rank: int) -> int:
        return sum(self.lora_params_of(shape, rank) for shape in self.layer_shapes)


def _size(num_params: int) -> str:
    """A parameter count as model names spell it: 1.7B, 494M, 86.9K."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if num_params >= scale:
            return f"{num_params / scale:.3g}{suffix}"
    return str(num_params)

"""A Hugging Face config's shape numbers, as :class:`~.model_shape.ModelSpec` fields.

What is read, family by family, beyond a Llama config's fields:

- a vision-language config (Gemma 3, Qwen3.5, Mistral 3): its ``text_config``, the
  language model only; the vision tower and projector are not counted (their
  parameters are a few hundred million; the predictor prices text training);
- mixture of experts: ``num_experts`` / ``num_local_experts`` / ``n_routed_experts``
  routed experts of ``moe_intermediate_size``, ``num_experts_per_tok``; shared
  experts from ``n_shared_experts`` (DeepSeek, GLM-4.5), ``shared_expert_intermediate_size``
  (Qwen, with a sigmoid gate) or ``moe_shared_expert_intermediate_size`` (Nemotron-H);
  dense layers from ``first_k_dense_replace`` (and DeepSeek's ``moe_layer_freq``) or
  Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``;
- MLA where ``kv_lora_rank`` is set (DeepSeek-V2/V3, Kimi K2);
- each layer's mixer from ``layer_types``, ``layers_block_type``,
  ``hybrid_override_pattern`` (Nemotron-H's M, *, -, E) or ``full_attention_interval``;
  Falcon-H1 runs attention and Mamba2 side by side in every layer;
- Gemma 4's full-attention layers' ``global_head_dim``, ``num_global_key_value_heads``
  and ``attention_k_eq_v``.

A layer kind the predictor cannot price is refused with a ValueError that names it,
and so are features that would change the counts unseen (per-layer input embeddings,
shared key-value layers, DeepSeek's sparse-attention indexer, Kimi's linear attention).
"""

from __future__ import annotations

from collections.abc import Mapping

from ..core.tiling import TILED_MODEL_TYPES
from .layer_kinds import (
    ATTENTION_MAMBA,
    DENSE,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    MOE,
    NO_FFN,
    NO_MIXER,
    SLIDING_ATTENTION,
    alternating_windows,
    dense_first,
)

_UNPRICED = {
    "hidden_size_per_layer_input": "per-layer input embeddings (Gemma 3n / Gemma 4 E-models)",
    "num_kv_shared_layers": "layers that share another layer's keys and values",
    "enable_moe_block": "Gemma 4's mixture-of-experts block",
    "altup_num_inputs": "Gemma 3n's AltUp streams",
    "index_n_heads": "DeepSeek sparse attention's indexer (DeepSeek-V3.2, GLM-5)",
    "linear_attn_config": "Kimi Delta Attention layers",
    "moe_latent_size": "latent mixture-of-experts projections (Nemotron 3)",
}
"""Config entries whose non-empty value means layers the predictor does not price."""
_COMMON_MIXERS = {
    FULL_ATTENTION: FULL_ATTENTION,
    "attention": FULL_ATTENTION,
    SLIDING_ATTENTION: SLIDING_ATTENTION,
    LINEAR_ATTENTION: LINEAR_ATTENTION,
    MAMBA: MAMBA,
}
_NEMOTRON_H = {  # Nemotron-H's layers: one block each (its 5.x names, its pattern's letters)
    "M": (MAMBA, NO_FFN),
    "mamba": (MAMBA, NO_FFN),
    "linear_attention": (MAMBA, NO_FFN),
    "*": (FULL_ATTENTION, NO_FFN),
    "attention": (FULL_ATTENTION, NO_FFN),
    "full_attention": (FULL_ATTENTION, NO_FFN),
    "-": (NO_MIXER, DENSE),
    "mlp": (NO_MIXER, DENSE),
    "E": (NO_MIXER, MOE),
    "moe": (NO_MIXER, MOE),
}


def text_values(config: Mapping) -> dict:
    """The language model's config: a composite config's ``text_config`` (its own
    ``tie_word_embeddings`` when it has one, else the top level's)."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        return dict(config)
    values = dict(text)
    if "tie_word_embeddings" not in values and "tie_word_embeddings" in config:
        values["tie_word_embeddings"] = config["tie_word_embeddings"]
    return values


def architecture(values: Mapping) -> str:
    architectures = values.get("architectures") or ()
    return architectures[0] if architectures else values.get("model_type") or "decoder"


def spec_fields(config: Mapping) -> dict:
    """The :class:`~.model_shape.ModelSpec` fields (all but its name) of ``config``."""
    values = text_values(config)
    try:
        fields = _fields(values, values.get("model_type") or "")
    except KeyError as missing:
        raise ValueError(f"the model config has no {missing} entry") from None
    # a vision-language model takes the general path, whatever its text model
    model_type = config.get("model_type") or ""
    return {**fields, "tiled_layers": model_type in TILED_MODEL_TYPES, "model_type": model_type}


def _fields(values: dict, model_type: str) -> dict:
    for key, what in _UNPRICED.items():
        if values.get(key):
            raise ValueError(f"the model config has {what} ({key}): the predictor cannot price it")
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    experts = (
        values.get("num_experts")
        or values.get("num_local_experts")
        or values.get("n_routed_experts")
        or 0
    )
    top_k = values.get("num_experts_per_tok") or values.get("experts_per_token") or 0
    if experts and not top_k:
        raise ValueError(
            f"the MoE config has {experts} experts but no num_experts_per_tok "
            "(or experts_per_token) entry"
        )
    mixers, ffns = _layer_kinds(values, model_type, bool(experts))
    num_layers = len(mixers)
    windows = sum(m == SLIDING_ATTENTION for m in mixers)
    first_dense = (values.get("first_k_dense_replace") or 0) if experts else 0
    dense_mlp = values.get("intermediate_size") or 0
    fields = {
        "hidden_size": hidden,
        "intermediate_size": dense_mlp if DENSE in ffns else 0,
        "num_layers": num_layers,
        "num_heads": heads,
        "num_kv_heads": values.get("num_key_value_heads") or heads,
        "head_dim": values.get("head_dim") or hidden // heads,
        "vocab_size": values["vocab_size"],
        "tie_word_embeddings": bool(values.get("tie_word_embeddings", False)),
        "num_experts": experts,
        "experts_per_token": top_k if experts else 0,
        "moe_intermediate_size": (values.get("moe_intermediate_size") or dense_mlp)
        if experts
        else 0,
        "sliding_window": values.get("sliding_window"),
        "window_layers": windows,
        "qk_norm": model_type.startswith(("qwen3", "gemma3", "gemma4"))
        or bool(values.get("use_qk_norm")),
        "first_k_dense_replace": first_dense,
        "norms_per_layer": 1 if model_type.startswith("nemotron_h") else 2,
        "mlp_gated": not model_type.startswith("nemotron_h"),
        "fused_projections": model_type == "phi3",
    }
    if model_type.startswith(("gemma2", "gemma3", "gemma4")):
        fields["norms_per_layer"] = 4  # pre and post norms around attention and MLP
    # the per-layer lists only where the uniform rules do not already say it
    if mixers != alternating_windows(num_layers, windows):
        fields["layer_types"] = mixers
    if ffns != dense_first(num_layers, bool(experts), first_dense):
        fields["ffn_types"] = ffns
    fields.update(_attention_fields(values, model_type, heads))
    fields.update(_shared_expert_fields(values) if experts else {})
    if LINEAR_ATTENTION in mixers:
        fields.update(_delta_net_fields(values, model_type))
    if MAMBA in mixers or ATTENTION_MAMBA in mixers:
        fields.update(_mamba_fields(values, model_type, hidden))
    return fields


def _layer_kinds(values: dict, model_type: str, moe: bool) -> tuple[tuple, tuple]:
    """Each layer's mixer and feed-forward block."""
    listed = values.get("layer_types") or values.get("layers_block_type")
    pattern = values.get("hybrid_override_pattern")
    if model_type.startswith("nemotron_h"):
        kinds = list(listed or pattern or "")
        unknown = sorted({k for k in kinds if k not in _NEMOTRON_H})
        if unknown or not kinds:
            raise ValueError(
                f"the Nemotron-H config has layer kinds the predictor cannot price: {unknown}"
            )
        return tuple(_NEMOTRON_H[k][0] for k in kinds), tuple(_NEMOTRON_H[k][1] for k in kinds)
    num_layers = values["num_hidden_layers"]
    if model_type.startswith("falcon_h1"):
        mixers = (ATTENTION_MAMBA,) * num_layers
    elif listed:
        unknown = sorted({k for k in listed if k not in _COMMON_MIXERS})
        if unknown:
            raise ValueError(
                "the model config has layer kinds the predictor cannot price: "
                f"{', '.join(map(repr, unknown))} (it prices {', '.join(_COMMON_MIXERS)})"
            )
        mixers = tuple(_COMMON_MIXERS[k] for k in listed)
    elif values.get("full_attention_interval"):
        every = values["full_attention_interval"]
        mixers = tuple(
            FULL_ATTENTION if (i + 1) % every == 0 else LINEAR_ATTENTION for i in range(num_layers)
        )
    else:
        mixers = alternating_windows(num_layers, _window_layers(values, num_layers))
    return mixers, _ffn_kinds(values, num_layers, moe)


def _window_layers(values: Mapping, num_layers: int) -> int:
    if values.get("sliding_window") and values.get("use_sliding_window"):
        return num_layers
    return 0


def _ffn_kinds(values: Mapping, num_layers: int, moe: bool) -> tuple[str, ...]:
    if not moe:
        return (DENSE,) * num_layers
    first = values.get("first_k_dense_replace") or 0
    every = values.get("moe_layer_freq") or values.get("decoder_sparse_step") or 1
    dense_only = set(values.get("mlp_only_layers") or ())
    sparse_step = "decoder_sparse_step" in values  # Qwen counts from 1, DeepSeek from 0
    return tuple(
        DENSE if i < first or i in dense_only or (i + sparse_step) % every else MOE
        for i in range(num_layers)
    )


def _attention_fields(values: Mapping, model_type: str, heads: int) -> dict:
    fields: dict = {}
    if model_type == "gpt_oss":
        fields.update(biases=True, sinks=True)
    elif model_type.startswith(("qwen2", "glm4")):  # q, k and v only
        fields["qkv_bias"] = model_type.startswith("qwen2") or bool(values.get("attention_bias"))
    elif values.get("kv_lora_rank"):
        pass  # MLA: attention_bias (on q_a, kv_a, o) is not counted
    else:
        fields["attention_bias"] = bool(values.get("attention_bias"))
    if model_type.startswith(("qwen3_next", "qwen3_5")) or values.get("attn_output_gate"):
        fields["attention_output_gate"] = True
    if values.get("kv_lora_rank"):
        nope, rope = values["qk_nope_head_dim"], values["qk_rope_head_dim"]
        fields.update(
            q_lora_rank=values.get("q_lora_rank") or 0,
            kv_lora_rank=values["kv_lora_rank"],
            qk_rope_head_dim=rope,
            qk_nope_head_dim=nope,
            v_head_dim=values["v_head_dim"],
            head_dim=nope + rope,
            num_kv_heads=heads,
        )
    if model_type.startswith("gemma4"):
        overrides: Mapping = next(iter((values.get("per_layer_config") or {}).values()), {})
        k_eq_v = bool(values.get("attention_k_eq_v"))
        global_kv = values.get("num_global_key_value_heads") or overrides.get("num_key_value_heads")
        fields.update(
            global_head_dim=values.get("global_head_dim") or overrides.get("head_dim") or 512,
            global_kv_heads=(global_kv or 0) if k_eq_v else 0,
            attention_k_eq_v=k_eq_v,
        )
    return fields


def _shared_expert_fields(values: Mapping) -> dict:
    if values.get("shared_expert_intermediate_size"):  # Qwen2-MoE, Qwen3-Next, Qwen3.5
        width = values["shared_expert_intermediate_size"]
        return {"n_shared_experts": 1, "shared_expert_intermediate_size": width,
                "shared_expert_gate": True}  # fmt: skip
    if values.get("moe_shared_expert_intermediate_size"):  # Nemotron-H
        return {
            "n_shared_experts": values.get("n_shared_experts") or 1,
            "shared_expert_intermediate_size": values["moe_shared_expert_intermediate_size"],
        }
    return {"n_shared_experts": values.get("n_shared_experts") or 0}


def _delta_net_fields(values: Mapping, model_type: str) -> dict:
    names = ("num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim")
    missing = [f"linear_{n}" for n in names if not values.get(f"linear_{n}")]
    if missing:
        raise ValueError(
            "the model config has linear_attention layers without the Gated DeltaNet "
            f"entries {', '.join(missing)}: the predictor cannot price them"
        )
    fields = {f"linear_{n}": values[f"linear_{n}"] for n in names}
    fields["linear_conv_kernel_dim"] = values.get("linear_conv_kernel_dim") or 4
    fields["linear_fused_inputs"] = model_type.startswith("qwen3_next")
    return fields


def _mamba_fields(values: Mapping, model_type: str, hidden: int) -> dict:
    def first(*keys, default=None):
        return next((values[k] for k in keys if values.get(k) is not None), default)

    heads = first("mamba_n_heads", "mamba_num_heads")
    state = first("mamba_d_state", "ssm_state_size")
    if not heads or not state:
        raise ValueError(
            "the model config has mamba layers without mamba_n_heads (mamba_num_heads) "
            "and mamba_d_state (ssm_state_size): the predictor cannot price them"
        )
    expand = first("mamba_expand", "expand", default=2)
    d_head = first("mamba_d_head", "mamba_head_dim")
    if not isinstance(d_head, int):  # Falcon-H1's "auto": its d_ssm split over the heads
        d_head = (first("mamba_d_ssm") or expand * hidden) // heads
    falcon = model_type.startswith("falcon_h1")
    return {
        "mamba_n_heads": heads,
        "mamba_d_head": d_head,
        "mamba_d_state": state,
        "mamba_n_groups": first("mamba_n_groups", "n_groups", default=1),
        "mamba_d_conv": first("mamba_d_conv", "conv_kernel", default=4),
        "mamba_expand": expand,
        "mamba_chunk_size": first("mamba_chunk_size", "chunk_size", default=256),
        "mamba_conv_bias": bool(first("mamba_conv_bias", "use_conv_bias", default=True)),
        "mamba_norm": bool(values.get("mamba_rms_norm")) if falcon else True,
    }

"""The shapes of the models ``roundpipe simulate --model`` knows by name, written from
their published ``config.json`` (no hub downloads), and the :class:`ModelSpec` that
holds a model's shape (:mod:`.model_shape`, read from any supported Hugging Face
config by ``ModelSpec.from_config``). Which counts decide memory, uploads and compute,
and where LoRA adapters sit: docs/design.md#model-shapes.
"""

from __future__ import annotations

from typing import TypedDict

from .layer_kinds import FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION
from .model_shape import ModelSpec

__all__ = ["MODEL_PRESETS", "ModelSpec", "model_preset"]


def _every(period: int, kind: str, others: str, layers: int) -> tuple[str, ...]:
    """``layers`` mixers: every ``period``-th (counting from 1) ``kind``, the others
    ``others`` (Qwen3.5's ``full_attention_interval``, Gemma's 5 local : 1 global)."""
    return tuple(kind if (i + 1) % period == 0 else others for i in range(layers))


class _DeltaNetFields(TypedDict):
    """Qwen3.5's Gated DeltaNet fields of a :class:`ModelSpec`."""

    linear_num_key_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    qk_norm: bool
    attention_output_gate: bool


_QWEN35_DELTANET: _DeltaNetFields = {  # Gated DeltaNet layers: 16 key heads, dims 128, 4 conv taps
    "linear_num_key_heads": 16,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "qk_norm": True,
    "attention_output_gate": True,
}
# Presets beyond the paper's models, from their config.json as published (text model
# only for the vision-language ones; multi-token-prediction layers, which Hugging Face
# does not load, are not counted). Values marked "unsure" are from memory of the
# config and only checked against the published parameter count. All but Llama take
# roundpipe's general path (Mistral Small 3.2 ships as a vision-language model): their
# layers do not tile (``tiled_layers=False``).
NEW_PRESETS = (
    # Qwen/Qwen3.5-9B text_config (transformers' Qwen3_5TextConfig defaults are its
    # values): 3 Gated DeltaNet layers, then one gated attention layer
    ModelSpec(
        "Qwen3.5-9B", 4096, 12288, 32, 16, 4, 256, 248320,
        layer_types=_every(4, FULL_ATTENTION, LINEAR_ATTENTION, 32),
        linear_num_value_heads=32,
        **_QWEN35_DELTANET,
        tiled_layers=False,
        model_type="qwen3_5",
    ),
    ModelSpec(
        "Qwen3.5-27B", 5120, 17408, 64, 24, 4, 256, 248320,  # unsure: the 24 heads
        layer_types=_every(4, FULL_ATTENTION, LINEAR_ATTENTION, 64),
        linear_num_value_heads=48,  # unsure
        **_QWEN35_DELTANET,
        tiled_layers=False,
        model_type="qwen3_5",
    ),
    # Qwen/Qwen3.5-35B-A3B (transformers' Qwen3_5MoeTextConfig defaults): all MoE
    ModelSpec(
        "Qwen3.5-35B-A3B", 2048, 0, 40, 16, 2, 256, 248320,
        num_experts=256,
        experts_per_token=8,
        moe_intermediate_size=512,
        n_shared_experts=1,
        shared_expert_intermediate_size=512,
        shared_expert_gate=True,
        layer_types=_every(4, FULL_ATTENTION, LINEAR_ATTENTION, 40),
        linear_num_value_heads=32,
        **_QWEN35_DELTANET,
        tiled_layers=False,
        model_type="qwen3_5_moe",
    ),
    # google/gemma-3-27b-pt text_config: 5 sliding (1024) : 1 global, sandwich norms
    ModelSpec(
        "Gemma-3-27B", 5376, 21504, 62, 32, 16, 128, 262208, True,
        sliding_window=1024,
        window_layers=52,
        layer_types=_every(6, FULL_ATTENTION, SLIDING_ATTENTION, 62),
        qk_norm=True,
        norms_per_layer=4,
        tiled_layers=False,
        model_type="gemma3",
    ),
    # google/gemma-4-31B text_config: global layers with 512-wide heads, 4 key heads
    # that are also the values (no v_proj)
    ModelSpec(  # unsure: the width 21504 and the 16 key-value heads of local layers
        "Gemma-4-31B", 5376, 21504, 60, 32, 16, 256, 262144, True,
        sliding_window=1024,
        window_layers=50,
        layer_types=_every(6, FULL_ATTENTION, SLIDING_ATTENTION, 60),
        qk_norm=True,
        norms_per_layer=4,
        global_head_dim=512,
        global_kv_heads=4,  # unsure: num_global_key_value_heads
        attention_k_eq_v=True,
        tiled_layers=False,
        model_type="gemma4",
    ),
    ModelSpec("Llama-3.3-70B", 8192, 28672, 80, 64, 8, 128, 128256, model_type="llama"),
    # microsoft/phi-4 (Phi3ForCausalLM: fused qkv and gate_up, the same weights)
    ModelSpec("Phi-4", 5120, 17920, 40, 40, 10, 128, 100352, fused_projections=True,
              tiled_layers=False, model_type="phi3"),
    # deepseek-ai/DeepSeek-V3: MLA, 3 dense layers, then 256 routed + 1 shared experts
    ModelSpec(
        "DeepSeek-V3", 7168, 18432, 61, 128, 128, 192, 129280,
        num_experts=256,
        experts_per_token=8,
        moe_intermediate_size=2048,
        first_k_dense_replace=3,
        n_shared_experts=1,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        tiled_layers=False,
        model_type="deepseek_v3",
    ),
    # zai-org/GLM-4.5-Air: biases on q, k, v; 1 dense layer, 128 routed + 1 shared
    ModelSpec(
        "GLM-4.5-Air", 4096, 10944, 46, 96, 8, 128, 151552,
        num_experts=128,
        experts_per_token=8,
        moe_intermediate_size=1408,
        first_k_dense_replace=1,
        n_shared_experts=1,
        qkv_bias=True,
        tiled_layers=False,
        model_type="glm4_moe",
    ),
    # mistralai/Mistral-Small-3.2-24B-Instruct-2506 text_config
    ModelSpec("Mistral-Small-3.2-24B", 5120, 32768, 40, 32, 8, 128, 131072, tiled_layers=False,
              model_type="mistral3"),
)  # fmt: skip

MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name.lower(): spec
    for spec in (
        ModelSpec(
            "Qwen3-1.7B", 2048, 6144, 28, 16, 8, 128, 151936, True, qk_norm=True, model_type="qwen3"
        ),
        ModelSpec(
            "Qwen3-8B", 4096, 12288, 36, 32, 8, 128, 151936, qk_norm=True, model_type="qwen3"
        ),
        ModelSpec("Llama-3.1-8B", 4096, 14336, 32, 32, 8, 128, 128256, model_type="llama"),
        ModelSpec(
            "gpt-oss-20b",
            2880,
            0,
            24,
            64,
            8,
            64,
            201088,
            num_experts=32,
            experts_per_token=4,
            moe_intermediate_size=2880,
            sliding_window=128,
            window_layers=12,
            biases=True,
            sinks=True,
            model_type="gpt_oss",
        ),
        ModelSpec(
            "Qwen3-32B", 5120, 25600, 64, 64, 8, 128, 151936, qk_norm=True, model_type="qwen3"
        ),
        ModelSpec(
            "Qwen3-30B-A3B",
            2048,
            0,
            48,
            32,
            4,
            128,
            151936,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=768,
            qk_norm=True,
            model_type="qwen3_moe",
        ),
        ModelSpec(
            "Qwen3-235B-A22B",
            4096,
            0,
            94,
            64,
            4,
            128,
            151936,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=1536,
            qk_norm=True,
            model_type="qwen3_moe",
        ),
        *NEW_PRESETS,
    )
}


def model_preset(name: str) -> ModelSpec:
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        known = ", ".join(s.name for s in MODEL_PRESETS.values())
        raise ValueError(
            f"unknown model preset {name!r}; known presets: {known}; "
            "for any other model give --config path/to/config.json"
        ) from None

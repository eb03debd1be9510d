"""Tiny random Hugging Face causal LMs, one per architecture, each with its quirks on.

The oracles of the architecture tests (fp32): every model is built from transformers'
own config class, seeded, with hidden size 64, 4 heads of 16 (2 KV heads where the
config has them), 4 layers (more where a layer pattern has a longer period), small MLPs
and 4 experts top-2; sliding windows and chunks (4) shorter than the 10-token batches.
``vlm`` models are the ``*ForConditionalGeneration`` classes with a tiny vision tower,
trained on text only: their vision towers get no gradient, nor do the DSA / CSA indexers
of glm_moe_dsa and deepseek_v4 (their top-k cuts them off from the loss). Left padding
is not the unpadded row for llama4 (temperature tuning), ministral3 / mistral4 (llama4
query scaling) and deepseek_v4 (compression blocks at absolute positions); right padding
is for all. ``python -m tests.support.check_architectures`` builds and checks them all.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

VOCAB = 128
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
)
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Keyword arguments a config's ``__post_init__`` consumes although they are no fields.
CONSUMED = {"global_head_dim", "num_global_key_value_heads"}
S, F = "sliding_attention", "full_attention"
LIN, CONV = "linear_attention", "conv"
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
LOCAL_EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)
GRANITE = dict(
    embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
    attention_multiplier=0.015, tie_word_embeddings=True,
)  # fmt: skip
MLA = dict(
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8,
    qk_nope_head_dim=16, v_head_dim=16,
)  # fmt: skip
DEEPSEEK_MOE = dict(
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
    first_k_dense_replace=1,
)  # fmt: skip
MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=4)
GATED_DELTANET = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, layer_types=[LIN, LIN, LIN, F],
)  # fmt: skip
GEMMA3 = dict(num_hidden_layers=6, sliding_window=4, layer_types=[S] * 5 + [F],
              query_pre_attn_scalar=16)  # fmt: skip
GEMMA_PLE = dict(num_hidden_layers=6, sliding_window=4, layer_types=[S, S, F] * 2,
                 num_kv_shared_layers=3, hidden_size_per_layer_input=8,
                 vocab_size_per_layer_input=VOCAB)  # fmt: skip
GEMMA4 = dict(final_logit_softcapping=30.0, global_head_dim=32)
LLAMA4 = dict(attention_chunk_size=4, no_rope_layers=[1, 1, 1, 0], num_local_experts=4,
              num_experts_per_tok=1, intermediate_size=32, intermediate_size_mlp=128,
              interleave_moe_layer_step=2, floor_scale=4, attn_scale=0.1)  # fmt: skip
QWEN3_5 = dict(GATED_DELTANET, rope_parameters=dict(
    rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25,
    mrope_section=[1, 1, 0], mrope_interleaved=True))  # fmt: skip
QWEN3_5_MOE = dict(QWEN3_5, **EXPERTS, shared_expert_intermediate_size=32)
QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=14,
                   out_hidden_size=64)  # fmt: skip
QWEN3_VISION = dict(QWEN_VISION, num_position_embeddings=16)  # a 4 x 4 grid
TINY_VIT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                image_size=28, patch_size=14)  # fmt: skip
MROPE = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])


def partial(factor: float) -> dict:
    return dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=factor)


def yarn(factor: float = 16.0, **extra) -> dict:
    """Yarn scaled to the tiny context: the original context is 128 / ``factor``."""
    base = dict(rope_type="yarn", rope_theta=1000000.0, factor=factor, beta_fast=32.0,
                beta_slow=1.0, original_max_position_embeddings=int(128 / factor))  # fmt: skip
    return {**base, **extra}


MISTRAL_YARN = yarn(mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                   high_freq_factor=4.0, original_max_position_embeddings=16)  # fmt: skip


@dataclass(frozen=True)
class Architecture:
    name: str
    model_type: str
    build: Callable[[], Any]
    vlm: bool = False
    notes: str = ""


def config(model_type: str, common: dict | None = None, **kwargs):
    """``model_type``'s config: ``common`` (``COMMON``) where the class has the field,
    then ``kwargs``, each of which must be a field (or a consumed keyword)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(kwargs) - fields - CONSUMED
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    base = {k: v for k, v in (COMMON if common is None else common).items() if k in fields}
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for key, inside in SPECIAL_TOKENS.items():  # ids beyond the tiny vocabulary
        if key in fields and isinstance(defaults[key], int | list) and "vocab_size" in base:
            ids = defaults[key] if isinstance(defaults[key], list) else [defaults[key]]
            if any(i >= VOCAB for i in ids):
                base[key] = inside
    return cls(**{**base, **kwargs})


def instantiate(cfg, cls: str | None = None, attn: str = "sdpa", vlm: bool = False):
    import transformers

    torch.manual_seed(0)
    if cls is not None:
        model = getattr(transformers, cls)._from_config(cfg, attn_implementation=attn)
    else:
        auto = (
            transformers.AutoModelForImageTextToText if vlm else transformers.AutoModelForCausalLM
        )
        model = auto.from_config(cfg, attn_implementation=attn)
    return model.float().train()


def text(model_type, cls=None, attn="sdpa", **kwargs) -> Callable[[], Any]:
    return lambda: instantiate(config(model_type, **kwargs), cls, attn)


def _arch(name, model_type, build, notes, vlm=False):
    return Architecture(name, model_type, build, vlm, notes)


# fmt: off
TEXT = [
    _arch("llama", "llama", text("llama", rope_parameters=LLAMA3_ROPE), "llama3 rope scaling"),
    _arch("mistral", "mistral", text("mistral", sliding_window=4), "sliding window 4"),
    _arch("qwen2", "qwen2", text("qwen2", use_sliding_window=True, sliding_window=4,
        max_window_layers=2, tie_word_embeddings=True), "qkv bias, sliding 4 on layers 2-3, tied"),
    _arch("qwen3", "qwen3", text("qwen3", tie_word_embeddings=True), "qk-norm, tied"),
    _arch("qwen3_moe", "qwen3_moe", text("qwen3_moe", **EXPERTS, norm_topk_prob=True),
        "MoE, qk-norm"),
    _arch("gpt_oss", "gpt_oss", text("gpt_oss", attn="eager", **LOCAL_EXPERTS,
        intermediate_size=32, sliding_window=4, layer_types=[S, F, S, F],
        rope_parameters=yarn(32.0, rope_theta=150000.0, truncate=False)),
        "sinks (eager), alternating sliding 4, biased MoE with clamped swiglu, yarn"),
    _arch("gemma", "gemma", text("gemma"), "embedding scale, (1+w) RMSNorm, gelu-tanh, tied"),
    _arch("gemma2", "gemma2", text("gemma2", attn="eager", sliding_window=4,
        layer_types=[S, F, S, F], final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        query_pre_attn_scalar=16), "soft-caps 30/50 (eager), alternating sliding 4"),
    _arch("gemma3_text", "gemma3_text", text("gemma3_text", **GEMMA3),
        "5:1 sliding 4, local/global rope, qk-norm, embedding scale, tied"),
    _arch("gemma3n_text", "gemma3n_text", text("gemma3n_text", **GEMMA_PLE, laurel_rank=8,
        activation_sparsity_pattern=[0.95, 0.95, 0.0, 0.0, 0.0, 0.0]),
        "altup, laurel, per-layer inputs, kv sharing, activation sparsity, soft-cap 30"),
    _arch("gemma4_text", "gemma4_text", text("gemma4_text", **GEMMA4, **GEMMA_PLE,
        use_double_wide_mlp=True), "E2B-like: per-layer inputs, kv sharing, double-wide MLP, "
        "global layers head 32 + partial rope, soft-cap 30"),
    _arch("gemma4_text_moe", "gemma4_text", text("gemma4_text", **GEMMA4, layer_types=[S, S, F] * 2,
        num_hidden_layers=6, hidden_size_per_layer_input=0, enable_moe_block=True,
        num_experts=4, top_k_experts=2, moe_intermediate_size=32, attention_k_eq_v=True,
        num_global_key_value_heads=1), "26B-A4B-like: MLP + MoE block, k=v on global layers"),
    _arch("phi3", "phi3", text("phi3", tie_word_embeddings=True, rope_parameters=partial(0.75)),
        "Phi-4-mini: fused qkv / gate-up, partial rotary 0.75, tied"),
    _arch("phi", "phi", text("phi", rope_parameters=partial(0.5)),
        "parallel block, LayerNorm, biases, partial rotary 0.5"),
    _arch("phimoe", "phimoe", text("phimoe", **LOCAL_EXPERTS, intermediate_size=32,
        router_jitter_noise=0.0, input_jitter_noise=0.0, attention_bias=True,
        lm_head_bias=True), "sparsemixer MoE (jitter_eps 0: its training-mode Gumbel "
        "sampling has one choice, yet draws random numbers), LayerNorm, biases, lm_head bias"),
    _arch("olmo2", "olmo2", text("olmo2"), "post-norm, full-width qk-norm"),
    _arch("olmo3", "olmo3", text("olmo3", sliding_window=4, layer_types=[S, S, S, F]),
        "3:1 sliding 4, post-norm, qk-norm"),
    _arch("granite", "granite", text("granite", **GRANITE), "multipliers 12/8/0.22/0.015, tied"),
    _arch("granitemoe", "granitemoe", text("granitemoe", **GRANITE, **LOCAL_EXPERTS,
        intermediate_size=32), "multipliers, MoE, tied"),
    _arch("granitemoehybrid", "granitemoehybrid", text("granitemoehybrid", **GRANITE,
        **LOCAL_EXPERTS, intermediate_size=32, shared_intermediate_size=64,
        layer_types=[LIN, LIN, LIN, F], position_embedding_type=None, **MAMBA2),
        "Granite 4: mamba2 3:1 NoPE attention, MoE + shared MLP, multipliers"),
    _arch("cohere", "cohere", text("cohere", logit_scale=0.0625, use_qk_norm=True),
        "logit_scale 0.0625, parallel block, LayerNorm, qk-norm, tied"),
    _arch("cohere2", "cohere2", text("cohere2", logit_scale=0.25, sliding_window=4,
        layer_types=[S, S, S, F]), "3:1 sliding 4, NoPE full layers, logit_scale 0.25"),
    _arch("smollm3", "smollm3", text("smollm3", no_rope_layers=[1, 1, 1, 0]),
        "NoPE every 4th layer, tied"),
    _arch("deepseek_v2", "deepseek_v2", text("deepseek_v2", **MLA, **{**DEEPSEEK_MOE,
        "n_shared_experts": 2}, topk_method="group_limited_greedy", n_group=2, topk_group=1,
        routed_scaling_factor=16.0), "MLA, group-limited MoE + 2 shared, dense first"),
    _arch("deepseek_v3", "deepseek_v3", text("deepseek_v3", **MLA, **DEEPSEEK_MOE,
        n_group=2, topk_group=1, routed_scaling_factor=2.5),
        "MLA, sigmoid group MoE + shared, dense first, interleaved rope"),
    _arch("deepseek_v4", "deepseek_v4", text("deepseek_v4", attn="eager",
        num_key_value_heads=1, q_lora_rank=32, partial_rotary_factor=0.25,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        layer_types=["heavily_compressed_attention", "compressed_sparse_attention"] * 2,
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        compress_rates={"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
        sliding_window=4, o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16,
        index_topk=2), "hyper-connections, compressed (HCA) / sparse (CSA) attention with "
        "sinks + sliding 4, grouped output, hash MoE first (eager)"),
    _arch("glm4", "glm4", text("glm4", attention_bias=True, rope_parameters=partial(0.5)),
        "sandwich norms, partial interleaved rotary 0.5, qkv bias"),
    _arch("glm4_moe", "glm4_moe", text("glm4_moe", **DEEPSEEK_MOE, routed_scaling_factor=2.5,
        use_qk_norm=True, attention_bias=True, rope_parameters=partial(0.5)),
        "GLM-4.5: sigmoid MoE + shared, dense first, qk-norm, partial rotary 0.5"),
    _arch("glm_moe_dsa", "glm_moe_dsa", text("glm_moe_dsa", **MLA, **DEEPSEEK_MOE,
        index_topk=4, index_head_dim=16, index_n_heads=8),
        "GLM-5: MLA + DSA indexer top-4, MoE + shared, dense first"),
    _arch("qwen3_next", "qwen3_next", text("qwen3_next", **GATED_DELTANET, **EXPERTS,
        shared_expert_intermediate_size=32, rope_parameters=partial(0.25)),
        "gated deltanet 3:1 gated attention, MoE + gated shared, partial rotary 0.25"),
    _arch("falcon_h1", "falcon_h1", text("falcon_h1", mamba_d_ssm=128, mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=4, mamba_rms_norm=True,
        embedding_multiplier=5.66, lm_head_multiplier=0.039, key_multiplier=0.39,
        attention_out_multiplier=0.94, mlp_multipliers=[0.88, 0.59],
        ssm_multipliers=[0.35, 0.25, 0.35, 0.5, 0.35], ssm_in_multiplier=1.25,
        ssm_out_multiplier=0.24), "attention + mamba2 in parallel in every layer, muP multipliers"),
    _arch("nemotron_h", "nemotron_h", text("nemotron_h", layers_block_type=[LIN, "moe", LIN,
        F, "moe", "mlp"], mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=2,
        chunk_size=4, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=64), "mamba2 / MoE / attention / relu2-MLP blocks"),
    _arch("llama4_text", "llama4_text", text("llama4_text", cls="Llama4ForCausalLM", **LLAMA4),
        "chunked attention 4, NoPE every 4th layer, attention temperature (floor 4), "
        "qk-norm, MoE top-1 + shared every other layer"),
    _arch("ministral", "ministral", text("ministral", sliding_window=4,
        layer_types=[S, F, S, F]), "alternating sliding 4"),
    _arch("ministral3", "ministral3", text("ministral3", rope_parameters=MISTRAL_YARN),
        "yarn, llama4 position-dependent query scaling"),
    _arch("exaone4", "exaone4", text("exaone4", sliding_window=4, layer_types=[S, S, S, F]),
        "3:1 sliding 4, NoPE full layers, post-norm, qk-norm"),
    _arch("starcoder2", "starcoder2", text("starcoder2", sliding_window=4),
        "sliding 4, LayerNorm, biases, gelu MLP, tied"),
    _arch("qwen2_moe", "qwen2_moe", text("qwen2_moe", **EXPERTS,
        shared_expert_intermediate_size=64), "MoE + gated shared expert, qkv bias"),
    _arch("mixtral", "mixtral", text("mixtral", **LOCAL_EXPERTS, intermediate_size=32), "MoE"),
    _arch("olmoe", "olmoe", text("olmoe", num_experts=4, num_experts_per_tok=2,
        intermediate_size=32), "MoE, full-width qk-norm"),
    _arch("minimax", "minimax", text("minimax", **LOCAL_EXPERTS, intermediate_size=32,
        layer_types=[LIN, LIN, LIN, F], block_size=4, full_attn_alpha_factor=3.56,
        linear_attn_alpha_factor=3.56, mlp_alpha_factor=3.56),
        "lightning attention 3:1 (block 4), scaled residuals, MoE"),
    _arch("kimi_linear", "kimi_linear", text("kimi_linear", **{**MLA, "q_lora_rank": None},
        layer_types=[LIN, LIN, LIN, F], mlp_layer_types=["dense"] + ["sparse"] * 3,
        num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, linear_head_dim=16, linear_num_heads=4,
        routed_scaling_factor=2.446), "KDA 3:1 NoPE MLA, MoE + shared, dense first"),
    _arch("lfm2", "lfm2", text("lfm2", layer_types=[CONV, CONV, F, CONV],
        block_multiple_of=32), "short conv 3:1 attention, qk-norm, auto ff dim, tied"),
    _arch("lfm2_moe", "lfm2_moe", text("lfm2_moe", layer_types=[CONV, CONV, F, CONV],
        num_dense_layers=1, **EXPERTS), "short conv + attention, dense first, MoE with bias"),
    _arch("seed_oss", "seed_oss", text("seed_oss", attention_bias=True,
        attention_dropout=0.0, residual_dropout=0.0), "qkv bias, no o bias"),
    _arch("hunyuan_v1_dense", "hunyuan_v1_dense", text("hunyuan_v1_dense",
        tie_word_embeddings=True), "qk-norm, tied"),
    _arch("ernie4_5", "ernie4_5", text("ernie4_5"), "interleaved rope, tied"),
    _arch("apertus", "apertus", text("apertus", rope_parameters=LLAMA3_ROPE),
        "xIELU activation, qk-norm, llama3 rope"),
    _arch("arcee", "arcee", text("arcee"), "relu2 MLP without gate"),
    _arch("dots1", "dots1", text("dots1", **DEEPSEEK_MOE), "MoE + shared, dense first, qk-norm"),
    _arch("bamba", "bamba", text("bamba", attn_layer_indices=[2], **MAMBA2),
        "mamba2 3:1 attention (partial rotary 0.5)"),
    _arch("jamba", "jamba", text("jamba", num_experts=4, num_experts_per_tok=2,
        intermediate_size=32, attn_layer_period=4, attn_layer_offset=2,
        expert_layer_period=2, expert_layer_offset=1),
        "mamba1 3:1 NoPE attention, MoE every other layer"),
    _arch("zamba2", "zamba2", text("zamba2", layers_block_type=[LIN, "hybrid"] * 2,
        num_key_value_heads=4, n_mamba_heads=8, mamba_d_state=16, chunk_size=4,
        num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=8,
        use_mem_rope=True), "mamba2 + 2 alternating shared attention blocks, LoRA adapters"),
    _arch("longcat_flash", "longcat_flash", text("longcat_flash", **MLA, head_dim=8,
        ffn_hidden_size=128, num_layers=2, moe_topk=2, n_routed_experts=4, zero_expert_num=2,
        expert_ffn_hidden_size=32),
        "2 layers of 2 attention + 2 MLP + shortcut MoE, MLA, zero experts"),
    _arch("mistral4", "mistral4", text("mistral4", cls="Mistral4ForCausalLM", **MLA,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        rope_parameters={**MISTRAL_YARN, "partial_rotary_factor": 1 / 3}),
        "MLA, MoE + shared, yarn, llama4 position-dependent query scaling"),
    _arch("qwen3_5_text", "qwen3_5_text", text("qwen3_5_text", **QWEN3_5),
        "gated deltanet 3:1 gated attention, partial mrope"),
    _arch("qwen3_5_moe_text", "qwen3_5_moe_text", text("qwen3_5_moe_text", **QWEN3_5_MOE),
        "gated deltanet 3:1 gated attention, MoE + gated shared"),
]


def vlm(model_type, text_type, text_kwargs, vision_type, vision_kwargs, **kwargs):
    def build():
        text_config = config(text_type, **text_kwargs)
        vision_config = config(vision_type, common={}, **vision_kwargs)
        cfg = config(model_type, common={}, text_config=text_config,
                     vision_config=vision_config, **kwargs)
        return instantiate(cfg, vlm=True)

    return build


VLMS = [
    _arch("qwen3_5_vlm", "qwen3_5", vlm("qwen3_5", "qwen3_5_text", QWEN3_5,
        "qwen3_5_vision", QWEN3_VISION), "Qwen3.5 (qwen3_5_text inside)", True),
    _arch("qwen3_5_moe_vlm", "qwen3_5_moe", vlm("qwen3_5_moe", "qwen3_5_moe_text", QWEN3_5_MOE,
        "qwen3_5_moe_vision", QWEN3_VISION), "Qwen3.5-MoE (qwen3_5_moe_text inside)", True),
    _arch("gemma3_vlm", "gemma3", vlm("gemma3", "gemma3_text", GEMMA3, "siglip_vision_model",
        {**TINY_VIT, "image_size": 56}, mm_tokens_per_image=4), "Gemma 3 4B+ (gemma3_text)", True),
    _arch("gemma4_vlm", "gemma4", vlm("gemma4", "gemma4_text", {**GEMMA4, **GEMMA_PLE},
        "gemma4_vision", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, position_embedding_size=64)),
        "Gemma 4 E2B-like (gemma4_text)", True),
    _arch("llama4_vlm", "llama4", vlm("llama4", "llama4_text", LLAMA4, "llama4_vision_model",
        {**TINY_VIT, "vision_output_dim": 32, "projector_input_dim": 32,
         "projector_output_dim": 64}), "Llama 4 (llama4_text)", True),
    _arch("mistral3_vlm", "mistral3", vlm("mistral3", "mistral", {"sliding_window": None},
        "pixtral", TINY_VIT), "Mistral Small 3.x (mistral text, pixtral)", True),
    _arch("qwen2_5_vl", "qwen2_5_vl", vlm("qwen2_5_vl", "qwen2_5_vl_text",
        {"rope_parameters": MROPE}, "qwen2_5_vl_vision", {**QWEN_VISION, "depth": 2,
        "window_size": 56, "fullatt_block_indexes": [1]}), "Qwen2.5-VL, mrope", True),
    _arch("qwen3_vl", "qwen3_vl", vlm("qwen3_vl", "qwen3_vl_text", {"rope_parameters":
        {**MROPE, "mrope_interleaved": True}}, "qwen3_vl_vision", {**QWEN3_VISION,
        "deepstack_visual_indexes": [0]}), "Qwen3-VL, interleaved mrope, qk-norm", True),
]
# fmt: on

ARCHITECTURES: tuple[Architecture, ...] = tuple(TEXT + VLMS)
# name -> why its tiny model cannot be built or run here; with transformers 5.25 every
# architecture above builds and trains (see check_architectures).
NOT_BUILDABLE: dict[str, str] = {}


def architecture(name: str) -> Architecture:
    for arch in ARCHITECTURES:
        if arch.name == name:
            return arch
    raise KeyError(name)


def padded_batch(
    rows: int = 5, length: int = 10, side: str = "right", seed: int = 0, vocab: int = VOCAB
) -> dict:
    """Random ids below ``vocab``; rows of different lengths (row 0 unpadded), padded on
    ``side``; labels -100 at the pads."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(rows):
        pad = (row * 3) % (length - 3)
        if pad:
            if side == "right":
                mask[row, length - pad :] = 0
            else:
                mask[row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def prompt_masked(batch: dict, prompt: int = 3) -> dict:
    """``batch`` with the first ``prompt`` label positions of row 1 (its first real
    tokens, whatever the padding side) set to -100."""
    labels = batch["labels"].clone()
    real = batch["attention_mask"][1].nonzero().flatten()[:prompt]
    labels[1, real] = -100
    return {**batch, "labels": labels}


def hf_loss_and_grads(model, batch: dict, **kwargs) -> tuple[torch.Tensor, dict]:
    """``model(**batch, **kwargs).loss`` and every parameter's gradient, on a deep copy
    of ``model``."""
    reference = copy.deepcopy(model)
    loss = reference(**batch, **kwargs).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in reference.named_parameters()}

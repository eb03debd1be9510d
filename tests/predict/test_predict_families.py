"""Layer kinds beyond Llama's in the predictor: MLA, shared experts and dense-first MoE,
Gated DeltaNet and Mamba2 hybrids, vision-language configs; the presets of the models
users ask about, against their published sizes; configs the predictor cannot price."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from roundpipe.cli import main
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.layer_kinds import (
    ATTENTION_MAMBA,
    DENSE,
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MAMBA,
    MOE,
    NO_FFN,
    NO_MIXER,
)
from roundpipe.predict.layer_terms import tiled_layer_bytes
from roundpipe.predict.model_specs import ModelSpec, model_preset
from roundpipe.predict.unit_costs import Kernels, layer_cost

# (preset, published total, published active or None, whether that active figure
# counts the LM head). Vision-language models: the text model (the vision tower is not
# counted). GLM-4.5-Air's "12B active" counts neither embedding nor LM head.
PUBLISHED = [
    ("Qwen3.5-9B", 9e9, None, True),
    ("Qwen3.5-27B", 27e9, None, True),
    ("Qwen3.5-35B-A3B", 35e9, 3e9, True),
    ("Gemma-3-27B", 27e9, None, True),
    ("Gemma-4-31B", 30.7e9, None, True),
    ("Llama-3.3-70B", 70.6e9, None, True),
    ("Phi-4", 14.7e9, None, True),
    ("DeepSeek-V3", 671e9, 37e9, True),
    ("GLM-4.5-Air", 106e9, 12e9, False),
    ("Mistral-Small-3.2-24B", 24e9, None, True),
]
NEW_PRESETS = [name for name, *_ in PUBLISHED]


@pytest.mark.parametrize(("name", "total", "active", "with_head"), PUBLISHED)
def test_each_new_preset_has_its_published_size(name, total, active, with_head):
    spec = model_preset(name)
    assert spec.num_params == pytest.approx(total, rel=0.03)
    if active is not None:
        counted = spec.active_params - (0 if with_head else spec.embedding_params)
        assert counted == pytest.approx(active, rel=0.03)
        assert spec.is_moe and spec.active_params < spec.num_params / 5


# Tiny configs built with transformers' own config classes: the predictor's count
# against the parameters of the model transformers builds (the text model).
_T = {"vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96}
_T |= {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
_DELTANET = {"linear_num_key_heads": 2, "linear_num_value_heads": 4}
_DELTANET |= {"linear_key_head_dim": 16, "linear_value_head_dim": 8}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 32}
_QWEN_VISION = {"hidden_size": 32, "intermediate_size": 64, "depth": 1, "num_heads": 2}
_SIGLIP = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1}
_SIGLIP |= {"num_attention_heads": 2, "image_size": 32, "patch_size": 8}
_GEMMA4_VISION = {k: _SIGLIP[k] for k in list(_SIGLIP)[:4]}
_MLA = {"kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16}
_MLA |= {"n_routed_experts": 8, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1}
TINY = {
    "qwen3_next": {**_T, **_DELTANET, **_MOE, "num_hidden_layers": 4, "num_experts": 8,
                   "shared_expert_intermediate_size": 48},
    "deepseek_v3": {**_T, **_MLA, **_MOE, "num_hidden_layers": 3, "q_lora_rank": 48},
    "deepseek_v2": {**_T, **_MLA, **_MOE, "num_hidden_layers": 3, "q_lora_rank": None,
                    "n_shared_experts": 2},
    "falcon_h1": {**_T, "num_hidden_layers": 2, "mamba_n_heads": 8, "mamba_d_head": 16,
                  "mamba_d_ssm": 128, "mamba_d_state": 16, "mamba_n_groups": 2},
    "nemotron_h": {**_T, **_MOE, "hybrid_override_pattern": "M-M*E-", "mamba_num_heads": 8,
                   "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
                   "n_routed_experts": 4, "moe_shared_expert_intermediate_size": 48},
    "qwen3_5": {"text_config": {**_T, **_DELTANET, "num_hidden_layers": 4},
                "vision_config": {**_QWEN_VISION, "out_hidden_size": 64}},
    "qwen3_5_moe": {"text_config": {**_T, **_DELTANET, **_MOE, "num_hidden_layers": 4,
                                    "num_experts": 8, "shared_expert_intermediate_size": 48},
                    "vision_config": {**_QWEN_VISION, "out_hidden_size": 64}},
    "gemma3": {"text_config": {**_T, "num_hidden_layers": 6, "sliding_window": 32},
               "vision_config": _SIGLIP, "mm_tokens_per_image": 4},
    "gemma4": {"text_config": {**_T, "num_hidden_layers": 6, "sliding_window": 32,
                               "global_head_dim": 32, "num_global_key_value_heads": 1,
                               "attention_k_eq_v": True, "hidden_size_per_layer_input": 0},
               "vision_config": _GEMMA4_VISION, "audio_config": None},
    "glm4_moe": {**_T, **_MOE, "num_hidden_layers": 3, "n_routed_experts": 4,
                 "n_shared_experts": 1, "first_k_dense_replace": 1, "attention_bias": True},
    "qwen2_moe": {**_T, **_MOE, "num_hidden_layers": 2, "num_experts": 4,
                  "shared_expert_intermediate_size": 48},
    "phi3": {**_T, "num_hidden_layers": 2, "pad_token_id": 0, "eos_token_id": 1},
}  # fmt: skip
_NOT_TEXT = ("vision", "visual", "multi_modal_projector", "embed_vision", "audio")


def _build(model_type: str):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(model_type, **TINY[model_type])
    return config, transformers.AutoModelForCausalLM.from_config(config)


def _text_params(model) -> int:
    named = model.named_parameters()
    return sum(p.numel() for n, p in named if not any(part in n for part in _NOT_TEXT))


@pytest.mark.parametrize("model_type", sorted(TINY))
def test_a_config_is_counted_as_transformers_builds_it(model_type):
    """Exact for every family here (the requirement is 1%): norms, convolutions, gates,
    biases, per-head scalars and the vision tower's absence included."""
    config, model = _build(model_type)
    spec = ModelSpec.from_config(config)
    assert spec.num_params == _text_params(model)
    assert spec.active_params <= spec.num_params
    # the config as a saved config.json reads the same
    assert ModelSpec.from_config(json.loads(config.to_json_string())).num_params == spec.num_params


def test_each_layer_kind_is_read_from_its_config():
    shapes = {t: ModelSpec.from_config(_build(t)[0]).layer_shapes for t in TINY}
    kinds = {t: [(s.mixer, s.ffn) for s in shape] for t, shape in shapes.items()}
    assert [m for m, _ in kinds["qwen3_next"]] == [LINEAR_ATTENTION] * 3 + [FULL_ATTENTION]
    assert {f for _, f in kinds["qwen3_next"]} == {MOE}
    assert [f for _, f in kinds["deepseek_v3"]] == [DENSE, MOE, MOE]  # first_k_dense_replace
    assert kinds["falcon_h1"] == [(ATTENTION_MAMBA, DENSE)] * 2
    assert kinds["nemotron_h"] == [  # "M-M*E-": one block a layer
        (MAMBA, NO_FFN), (NO_MIXER, DENSE), (MAMBA, NO_FFN),
        (FULL_ATTENTION, NO_FFN), (NO_MIXER, MOE), (NO_MIXER, DENSE),
    ]  # fmt: skip
    assert [m for m, _ in kinds["gemma3"]].count(FULL_ATTENTION) == 1


@pytest.mark.parametrize(
    "model_type",
    ["qwen3_5", "qwen3_5_moe", "gemma3", "gemma4", "qwen2_moe", "qwen3_next", "deepseek_v2",
     "deepseek_v3", "glm4_moe", "phi3"],
)  # fmt: skip
def test_lora_adapts_the_linear_layers_peft_adapts(model_type):
    """PEFT's all-linear, as the installed peft applies it: from 0.22 it adapts the
    routed experts and the router of the mixtures of experts transformers v5 stacked
    (qwen2_moe, qwen3_next, DeepSeek, GLM), not Qwen3.5's."""
    peft = pytest.importorskip("peft")
    config, model = _build(model_type)
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules="all-linear"))
    named = adapted.named_parameters()
    want = sum(p.numel() for n, p in named if "lora_" in n and "vision" not in n)
    assert ModelSpec.from_config(config).lora_params(8) == want, model_type


# The published config.json entries of three presets (text_config of the composite
# ones): read by from_config, they are the presets.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 129280,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
}
QWEN35_35B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "vocab_size": 248320,
        "tie_word_embeddings": False,
    },
    "vision_config": {"depth": 27, "hidden_size": 1152},
}
GEMMA4_31B = {
    "architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
    "text_config": {
        "model_type": "gemma4_text", "hidden_size": 5376, "intermediate_size": 21504,
        "num_hidden_layers": 60, "num_attention_heads": 32, "num_key_value_heads": 16,
        "head_dim": 256, "global_head_dim": 512, "num_global_key_value_heads": 4,
        "attention_k_eq_v": True, "sliding_window": 1024, "vocab_size": 262144,
        "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 0,
        "enable_moe_block": False, "tie_word_embeddings": True,
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 10,
    },
}  # fmt: skip


@pytest.mark.parametrize(
    ("config", "name"),
    [(DEEPSEEK_V3, "DeepSeek-V3"), (QWEN35_35B, "Qwen3.5-35B-A3B"), (GEMMA4_31B, "Gemma-4-31B")],
)
def test_a_published_config_reads_as_its_preset(config, name):
    preset = model_preset(name)
    assert replace(ModelSpec.from_config(config), name=preset.name) == preset


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({**_T, "num_hidden_layers": 2, "layer_types": ["full_attention", "chunked_attention"]},
         "cannot price: 'chunked_attention'"),
        ({**_T, "num_hidden_layers": 1, "layer_types": ["linear_attention"]},
         "without the Gated DeltaNet entries"),
        ({**_T, "num_hidden_layers": 1, "layer_types": ["mamba"]}, "mamba layers without"),
        ({**_T, "num_hidden_layers": 1, "index_n_heads": 64}, "sparse attention's indexer"),
        ({"text_config": {**_T, "model_type": "gemma4_text", "num_hidden_layers": 1,
                          "hidden_size_per_layer_input": 256}}, "per-layer input embeddings"),
        ({**_T, "model_type": "nemotron_h", "hybrid_override_pattern": "M*X"}, "'X'"),
    ],
)  # fmt: skip
def test_layers_the_predictor_cannot_price_are_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        ModelSpec.from_config(config)


def test_a_spec_with_an_unknown_layer_kind_is_refused():
    with pytest.raises(ValueError, match="cannot price: 'conv'"):
        ModelSpec("x", 64, 96, 2, 4, 2, 16, 1000, layer_types=(FULL_ATTENTION, "conv"))
    with pytest.raises(ValueError, match="3 feed-forward kinds given for 2 layers"):
        ModelSpec("x", 64, 96, 2, 4, 2, 16, 1000, ffn_types=(DENSE,) * 3)


@pytest.mark.parametrize(
    ("name", "mixer"),
    [("Qwen3.5-9B", LINEAR_ATTENTION), ("Qwen3.5-35B-A3B", LINEAR_ATTENTION), ("nemotron", MAMBA)],
)
def test_linear_mixers_cost_linearly_in_the_sequence(name, mixer):
    """Gated DeltaNet and Mamba2 layers: no S x S term, time and bytes per token flat in
    S; their model's attention layers grow with S."""
    spec = (
        ModelSpec.from_config(_build("nemotron_h")[0]) if name == "nemotron" else model_preset(name)
    )
    kernels = Kernels(gpu_preset("rtx4090"), "bf16")
    linear = next(s for s in spec.layer_shapes if s.mixer == mixer)
    attention = next(s for s in spec.layer_shapes if s.mixer == FULL_ATTENTION)
    short, long = 4096, 65536
    for shape in (linear, attention):
        a = layer_cost(spec, kernels, short, short, None, 0, layer=shape)
        b = layer_cost(spec, kernels, long, long, None, 0, layer=shape)
        assert b.activation_bytes / long == pytest.approx(a.activation_bytes / short, rel=1e-6)
        if shape == linear:  # seconds per token do not grow (an MoE layer's expert
            # weights are read once per microbatch: they fall)
            assert (b.forward + b.backward) / long <= (a.forward + a.backward) / short * (1 + 1e-9)
    flops = {
        shape.mixer: [spec.mixer(shape.mixer).sequence_flops(s, s, None) / s for s in (short, long)]
        for shape in (linear, attention)
    }
    assert flops[mixer][0] == flops[mixer][1] > 0
    assert flops[FULL_ATTENTION][1] / flops[FULL_ATTENTION][0] == pytest.approx(
        (long + 1) / (short + 1)
    )
    per_token = [tiled_layer_bytes(spec, s, s, linear) / s for s in (short, long)]
    assert per_token[0] == pytest.approx(per_token[1], rel=0.01)  # one chunk's set aside


def test_mla_prices_its_latents_and_its_wider_heads():
    spec = model_preset("DeepSeek-V3")
    mla = spec.mixer(FULL_ATTENTION)
    h, heads = spec.hidden_size, spec.num_heads
    q = h * 1536 + 1536 * heads * 192
    kv = h * (512 + 64) + 512 * heads * (128 + 128)
    assert mla.params == q + kv + heads * 128 * h + 1536 + 512
    dense, moe = dict.fromkeys(spec.layer_shapes)
    assert (dense.ffn, moe.ffn) == (DENSE, MOE)
    shared = 3 * h * 2048  # one shared expert, always run
    assert spec.active_params_of(moe) - spec.active_params_of(dense) == pytest.approx(
        9 * shared + spec.router_params - 3 * h * 18432
    )


def _rows(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


# adapters on their other linears (peft 0.22's all-linear adds every routed expert's:
# their folded stacks outgrow a 24 GB GPU, tests/predict/test_peft_targets.py)
LORA = {
    "DeepSeek-V3": ["--lora", "16", "--quantize", "nf4", "--no-lora-experts"],
    "GLM-4.5-Air": ["--lora", "16", "--no-lora-experts"],
}


@pytest.mark.parametrize("name", NEW_PRESETS)
def test_simulate_runs_every_new_preset(name, capsys):
    """On 8 RTX 4090s and 1 TB of host RAM; the two largest MoE models with LoRA (the
    first: one MoE layer's bf16 weights alone outgrow a 24 GB GPU), 1024 tokens (the
    262K vocabularies' head outgrows a stage at 2048)."""
    argv = ["simulate", "--model", name, "--gpu", "rtx4090", "--json", *LORA.get(name, [])]
    main([*argv, "--schedule", "roundpipe", "--host-ram", "1024", "--seq-len", "1024"])
    (row,) = _rows(capsys)
    assert row["tokens_per_s"] > 0 and row["fits"], row["detail"]
    main([*argv, "--max-seq-len"])
    (longest,) = _rows(capsys)
    assert longest["max_seq_len"] >= 4096 and longest["bound_by"] == "gpu"

"""Which routed experts peft's ``all-linear`` LoRA adapts.

Transformers v5 stacks a mixture of experts' per-expert linears into one parameter per
projection (``gate_up_proj``, ``down_proj``) and turns the router into its own module.
peft 0.21 adapted neither; from 0.22, peft converts a config's v4 targets for the model
types whose experts v5 converted (``peft.utils.transformers_weight_conversion``), so that
``all-linear`` adapts what it adapted on v4: every expert's gate and up projections, as
one adapter on the fused ``gate_up_proj`` at twice the rank, its down projection, and
the router's weight. :data:`EXPERT_CONVERSION_TYPES` is that list of model types (the
keys peft 0.22 maps to its ``mixtral`` and ``qwen2_moe`` patterns; a test holds it to
the installed peft's), read by name so that pricing a model does not import peft.
"""

from __future__ import annotations

import functools
from importlib.metadata import PackageNotFoundError, version

EXPERT_CONVERSION_TYPES = frozenset(
    {
        # peft's "mixtral" pattern: w1, w3 -> gate_up_proj, w2 -> down_proj, gate
        "mixtral",
        "minimax",
        "minimax_m2",
        # its "qwen2_moe" pattern: gate_proj, up_proj -> gate_up_proj, down_proj, gate
        "qwen2_moe",
        "qwen3_moe",
        "qwen3_next",
        "qwen3_omni_moe",
        "qwen3_omni_moe_thinker",
        "qwen3_omni_moe_text",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "glm4_moe",
        "glm4_moe_lite",
        "glm4v_moe",
        "glm_moe_dsa",
        "dots1",
        "Dots3NoteTextModel",
        "afmoe",
        "ernie4_5_moe",
        "longcat_flash",
        "solar_open",
        "mellum",
        "beam",
        "hunyuan_v1_moe",
        "flex_olmo",
        "olmoe",
        "sarvam_mla",
        "exaone_moe",
        "cohere2_moe",
        "UnlimitedOcrTextModel",
    }
)
EXPERT_TARGET_NAMES = frozenset({"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3", "gate"})
"""The v4 module names peft converts to the experts' stacks and the router (the keys of
its mappings): a target list naming one of them adapts the routed experts."""
NF4_EXPERT_TYPES = frozenset({"qwen3_moe", "gpt_oss"})
"""The model types whose stacked experts ``quantize="nf4"`` quantizes
(``roundpipe.hf.nf4_experts.SUPPORTED``): over such a base they stay frozen, and
``all-linear`` (resolved on the dense model's ``nn.Linear`` names first) adapts neither
them nor the router."""
FIRST_CONVERTING_PEFT = (0, 22)


@functools.cache
def peft_converts_experts() -> bool:
    """Whether the installed peft converts experts' targets (0.22 and later)."""
    try:
        installed = version("peft")
    except PackageNotFoundError:
        return False
    parts = [int("".join(c for c in part if c.isdigit()) or 0) for part in installed.split(".")]
    return tuple(parts[:2]) >= FIRST_CONVERTING_PEFT


def adapts_routed_experts(model_type: str) -> bool:
    """Whether peft's ``all-linear`` adapts the routed experts of a ``model_type`` model."""
    return model_type in EXPERT_CONVERSION_TYPES and peft_converts_experts()


def targets_reach_experts(targets: str | list[str] | tuple[str, ...]) -> bool:
    """Whether LoRA ``target_modules`` reach the routed experts of a model peft converts:
    ``"all-linear"``, or a list naming an expert projection (by its last part, as peft
    matches a list)."""
    if isinstance(targets, str):
        return targets == "all-linear"
    return any(target.rsplit(".", 1)[-1] in EXPERT_TARGET_NAMES for target in targets)

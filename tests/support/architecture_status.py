"""What the architecture tests expect of each architecture, and the README's table of it.

The lists here are the expectations ``tests/hf/test_hf_architecture*.py`` check (an entry
that stopped being true fails a test); :func:`readme_table` renders them as the
README's supported-architectures table, which ``test_readme_architecture_table``
keeps equal to this rendering (``python bench/model_breadth.py --readme`` prints it).
"""

from __future__ import annotations

from roundpipe.hf.families import FAMILIES

from .architectures import ARCHITECTURES

REFUSED = {
    "gemma3n_text": "does more than pass each layer's output to the next",
    "deepseek_v4": "does more than pass each layer's output to the next",
}
"""Architecture → why ``from_hf`` refuses it (the message it must contain)."""
TRAINED = [arch.name for arch in ARCHITECTURES if arch.name not in REFUSED]
LORA_FAILS_IN_PEFT = {
    "falcon_h1": "peft refuses all-linear on Mamba models (conv1d, out_proj)",
    "nemotron_h": "peft refuses all-linear on Mamba models (conv1d, out_proj)",
    "phimoe": "peft's LoRA fails on its router, which returns a tuple",
    "llama4_text": "peft's LoRA fails on its router, which returns a tuple",
    "llama4_vlm": "peft's LoRA fails on its router, which returns a tuple",
}
"""Architecture → what peft itself does with ``all-linear`` on the model alone."""
PACKING_REFUSED = {
    "qwen2_5_vl": "M-RoPE positions",
    **{
        name: "carry a state along the sequence"
        for name in (
            "granitemoehybrid", "qwen3_next", "falcon_h1", "nemotron_h", "minimax",
            "kimi_linear", "lfm2", "lfm2_moe", "bamba", "jamba", "zamba2", "qwen3_5_text",
            "qwen3_5_moe_text", "qwen3_5_vlm", "qwen3_5_moe_vlm",
        )
    },
}  # fmt: skip
"""Architecture → why packed sequences are refused (the message it must contain)."""
EXPERTS_QUANTIZED = ("qwen3_moe", "gpt_oss")
"""NF4 stacked experts too: checked against bitsandbytes in test_nf4_experts.py."""
NF4_TESTED = [n for n in TRAINED if n not in LORA_FAILS_IN_PEFT and n not in EXPERTS_QUANTIZED]

_YES, _NO = "✓", "—"


def readme_table() -> str:
    """The supported-architectures table of the README, from the lists above."""
    header = (
        "| Architecture (`model_type`) | What it exercises | Trains | LoRA all-linear "
        "| NF4 base + LoRA | Packing | Tiled long context |\n"
        "|---|---|---|---|---|---|---|"
    )
    rows = [header]
    for arch in ARCHITECTURES:
        trains = arch.name not in REFUSED
        cells = [
            f"{arch.name} (`{arch.model_type}`)",
            arch.notes.replace("|", "/"),
            _YES if trains else f"refused: {REFUSED[arch.name]}",
            _cell(trains, arch.name not in LORA_FAILS_IN_PEFT, "peft fails"),
            _cell(trains, arch.name in NF4_TESTED or arch.name in EXPERTS_QUANTIZED, "—"),
            _cell(trains, arch.name not in PACKING_REFUSED, "refused"),
            _YES if arch.model_type in FAMILIES else _NO,
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _cell(trains: bool, works: bool, otherwise: str) -> str:
    if not trains:
        return _NO
    return _YES if works else otherwise

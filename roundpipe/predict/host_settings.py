"""The lean settings a prediction is of, and the host bytes each one costs per parameter.

Three choices trade host RAM for precision (docs/design.md#prediction-assumptions):
``--optimizer-states`` (AdamW's two moments in fp32, bf16 or 8 bits), ``--master-weights``
(fp32 masters, or the bf16 model's own weights as masters) and, under LoRA,
``--quantize nf4`` (the frozen base's linear weights in 4 bits). The defaults are what
RoundPipe holds without them, so a prediction with the defaults is exactly today's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

OPTIMIZER_STATES = ("fp32", "bf16", "int8")
"""``--optimizer-states``, the most precise first."""
MASTER_WEIGHTS = ("fp32", "bf16")
"""``--master-weights``, the most precise first."""
QUANTIZE = (None, "nf4")
"""``--quantize`` (``None``: the base in the model dtype)."""

INT8_BLOCK = 256
"""Elements per fp32 scale of an 8-bit moment (torchao's ``AdamW8bit`` ``block_size``)."""
NF4_BLOCK = 64
"""Elements per fp32 absmax of an NF4 weight (bitsandbytes' default, no double
quantization)."""

MOMENT_BYTES = {
    "fp32": Fraction(2 * 4),
    "bf16": Fraction(2 * 2),
    "int8": 2 * (1 + Fraction(4, INT8_BLOCK)),  # 2.03125: codes and a scale per block
}
"""Bytes per trained parameter of AdamW's m and v together."""
MASTER_COPY_BYTES = {"fp32": 4, "bf16": 0}
"""Bytes per trained parameter of its master beyond its upload buffer: bf16 masters of
a bf16 model are the model's own weights."""
MASTER_GRADIENT_BYTES = {"fp32": 4, "bf16": 2}
"""Bytes per trained parameter of its gradient, kept in the masters' dtype."""
NF4_BYTES = Fraction(1, 2) + Fraction(4, NF4_BLOCK)
"""Bytes per NF4 weight: two 4-bit codes a byte and an fp32 absmax per block (0.5625)."""
DEQUANTIZED_BYTES = 2
"""Bytes per weight of the bf16 copy the GPU dequantizes into."""


def nf4_bytes(num_params: int) -> int:
    """Host (and upload) bytes of ``num_params`` weights in NF4."""
    return math.ceil(num_params * NF4_BYTES)


def moment_bytes(num_params: int, optimizer_states: str, shards: int = 1) -> int:
    """AdamW's state of ``num_params`` trained parameters, split over ``shards`` hosts."""
    return math.ceil(num_params * MOMENT_BYTES[optimizer_states] / shards)


@dataclass(frozen=True)
class LeanSettings:
    """What the host keeps of each trained (and, quantized, frozen) parameter."""

    optimizer_states: str = "fp32"
    master_weights: str = "fp32"
    quantize: str | None = None

    def check(self, precision: str, lora_rank: int) -> None:
        """Refuse a value the runtime has no such setting for, or a combination it cannot
        run, naming the flag and what is allowed."""
        if self.optimizer_states not in OPTIMIZER_STATES:
            raise ValueError(
                f"--optimizer-states {self.optimizer_states!r}: use one of "
                f"{', '.join(OPTIMIZER_STATES)}"
            )
        if self.master_weights not in MASTER_WEIGHTS:
            raise ValueError(
                f"--master-weights {self.master_weights!r}: use one of {', '.join(MASTER_WEIGHTS)}"
            )
        if self.quantize not in QUANTIZE:
            raise ValueError(f"--quantize {self.quantize!r}: the only quantization is nf4")
        if self.master_weights == "bf16" and precision != "bf16":
            raise ValueError(
                "--master-weights bf16 makes the model's own bf16 weights the masters, so it "
                f"needs a bf16 model (--precision bf16), got --precision {precision}"
            )
        if self.quantize and not lora_rank:
            raise ValueError(
                f"--quantize {self.quantize} quantizes a frozen base, which only LoRA has: "
                "give --lora R with it"
            )

    @property
    def is_default(self) -> bool:
        return self == DEFAULT_SETTINGS

    @property
    def flags(self) -> str:
        """The command-line options that give these settings (the defaults left out)."""
        parts = []
        if self.optimizer_states != "fp32":
            parts.append(f"--optimizer-states {self.optimizer_states}")
        if self.master_weights != "fp32":
            parts.append(f"--master-weights {self.master_weights}")
        if self.quantize:
            parts.append(f"--quantize {self.quantize}")
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {
            "optimizer_states": self.optimizer_states,
            "master_weights": self.master_weights,
            "quantize": self.quantize,
        }


DEFAULT_SETTINGS = LeanSettings()
"""What RoundPipe holds without a lean option: fp32 moments and masters, the base in the
model dtype."""

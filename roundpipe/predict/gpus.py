"""GPU presets, half-precision modes and PCIe generations for model-level predictions.

Vendors' published dense tensor-core FLOP/s, memory and memory bandwidth; which rate a
precision mode runs at on which card, and what a PCIe link delivers, are in
docs/design.md#gpu-presets.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3

PRECISIONS = ("fp16-acc16", "fp16", "bf16")

PCIE_BANDWIDTH = {3: 12e9, 4: 25e9, 5: 50e9}
"""Bytes/s per direction that pinned host<->device copies reach on an x16 link."""


@dataclass(frozen=True)
class Gpu:
    """One GPU model."""

    name: str
    fp16_acc16_flops: float
    """Dense tensor FLOP/s with fp16 accumulation."""
    fp32_acc_flops: float
    """Dense tensor FLOP/s of fp16/bf16 inputs with fp32 accumulation."""
    memory_bytes: int
    memory_bandwidth: float
    """Device memory bytes/s."""
    pcie_generation: int

    def __post_init__(self) -> None:
        if self.pcie_generation not in PCIE_BANDWIDTH:
            known = ", ".join(map(str, PCIE_BANDWIDTH))
            raise ValueError(f"PCIe generation {self.pcie_generation} unknown; known: {known}")

    def matmul_flops(self, precision: str) -> float:
        """Peak dense tensor FLOP/s of a matmul in ``precision``."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
        return self.fp16_acc16_flops if precision == "fp16-acc16" else self.fp32_acc_flops

    @property
    def attention_flops(self) -> float:
        """Peak FLOP/s flash attention works against (it accumulates in fp32)."""
        return self.fp32_acc_flops

    @property
    def pcie_bandwidth(self) -> float:
        return PCIE_BANDWIDTH[self.pcie_generation]

    # What the simulator's command-line synthetic mode and older callers read.
    @property
    def flops(self) -> float:
        return self.fp32_acc_flops

    @property
    def h2d_bandwidth(self) -> float:
        return self.pcie_bandwidth

    @property
    def d2h_bandwidth(self) -> float:
        return self.pcie_bandwidth


GPU_PRESETS: dict[str, Gpu] = {
    gpu.name: gpu
    for gpu in (
        Gpu("rtx3090", 142e12, 71e12, 24 * GIB, 936e9, 4),
        Gpu("rtx4090", 330.3e12, 165.2e12, 24 * GIB, 1008e9, 4),
        Gpu("rtx5090", 419e12, 209.5e12, 32 * GIB, 1792e9, 5),
        Gpu("a800", 312e12, 312e12, 80 * GIB, 1935e9, 4),
        Gpu("h100", 989e12, 989e12, 80 * GIB, 3350e9, 5),
        Gpu("h200", 989e12, 989e12, 140 * GIB, 4800e9, 5),
    )
}


def gpu_preset(name: str) -> Gpu:
    try:
        return GPU_PRESETS[name.lower()]
    except KeyError:
        known = ", ".join(GPU_PRESETS)
        raise ValueError(f"unknown GPU preset {name!r}; known presets: {known}") from None

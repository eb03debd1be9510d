"""What an NF4 base saves on the PCIe links, and what dequantizing it costs the GPUs.

With ``--quantize nf4`` every decoder layer's frozen linear weights travel as NF4 codes
and scales (:data:`.host_settings.NF4_BYTES` a weight instead of 2), so each upload of a
layer is smaller: the unit costs carry the quantized bytes, the simulated round and its
tokens/s follow. Here are the per-iteration figures the prediction states beside them
(docs/design.md#prediction-assumptions).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..core.plan import Plan
from .gpus import PCIE_BANDWIDTH, Gpu
from .host_settings import nf4_bytes
from .model_specs import ModelSpec
from .models import Workload
from .unit_costs import HALF, Kernels, dequantize_time, dequantized_params


@dataclass(frozen=True)
class UploadSavings:
    """Per iteration of the whole batch."""

    upload_saved_bytes: int
    """Host-to-GPU bytes the NF4 uploads save, all GPUs together."""
    upload_saved_s: float
    """Those bytes at one link's bandwidth: upload seconds saved, summed over the GPUs'
    links (each carries its stages' share)."""
    dequantize_s: float
    """GPU seconds dequantizing the uploaded weights, summed over the GPUs: every pass
    over a layer dequantizes it again, per microbatch (its forward stage's forward, its
    backward stage's recompute and backward)."""
    layer_uploads: int
    """Decoder-layer uploads per round (a layer of a forward stage is uploaded twice: for
    its forward and for its backward stage)."""

    def to_dict(self) -> dict:
        return {
            "upload_saved_bytes": self.upload_saved_bytes,
            "upload_saved_s": self.upload_saved_s,
            "dequantize_s": self.dequantize_s,
        }


def upload_savings(
    spec: ModelSpec, gpu: Gpu, work: Workload, num_gpus: int, plan: Plan
) -> UploadSavings | None:
    """The figures for ``plan`` (units: the embedding, the layers, the head); ``None``
    without a quantized base."""
    if work.settings.quantize is None:
        return None
    layers = range(1, spec.num_layers + 1)
    shapes = spec.layer_shapes
    stages = [*plan.forward_ranges(), *plan.backward_ranges()]
    uploaded = [
        shapes[i - 1] for r in stages for i in range(max(r.start, 1), min(r.stop, layers.stop))
    ]
    uploads = len(uploaded)
    rounds = work.num_microbatches / work.round_microbatches(num_gpus)
    # per kind of layer: its uploads and its passes per microbatch, one per upload
    # (forward; recompute or the fused forward) plus every layer's backward
    kinds = Counter(uploaded)
    passes = Counter(shapes)
    passes.update(kinds)
    saved = round(
        sum(n * rounds * _saved_bytes(spec.linear_weights_of(s)) for s, n in kinds.items())
    )
    pcie = PCIE_BANDWIDTH[work.pcie] if work.pcie else gpu.pcie_bandwidth
    kernels = Kernels(gpu, work.precision, work.mfu)
    tokens = work.tokens_per_microbatch
    dequantize_s = sum(
        dequantize_time(dequantized_params(spec, tokens, s), kernels) * n * work.num_microbatches
        for s, n in passes.items()
    )
    return UploadSavings(
        upload_saved_bytes=saved,
        upload_saved_s=saved / pcie,
        dequantize_s=dequantize_s,
        layer_uploads=uploads,
    )


def _saved_bytes(weights: int) -> int:
    """Upload bytes NF4 saves on ``weights`` linear weights."""
    return weights * HALF - nf4_bytes(weights)

"""GPU check of the NF4 base weights: CUDA dequantizes bit for bit as the CPU does.

Usage: python3 bench/gpu_nf4_check.py [--device cuda:0] (``--device cpu``: a dry run
of the script itself). Needs torch with CUDA only
(no bitsandbytes: where it is installed, its kernel, which ``NF4Linear`` then uses on
CUDA, is compared too). For several shapes and dtypes (rows shorter than a block,
partial last blocks, odd counts, a weight larger than one dequantize chunk): the
bytes quantized on the host, dequantized on the GPU with the torch ops, equal the CPU
dequantize bit for bit; ``NF4Linear`` on the GPU gives ``F.linear`` over that weight
and the input gradient of its backward. Prints one JSON line (``ok``, the cases,
dequantize throughput) and exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
from torch.nn import functional as F

from roundpipe.hf.nf4 import NF4Linear, dequantize
from roundpipe.hf.nf4_format import dequantize_nf4, quantize_nf4

SHAPES = [(4096, 4096), (14336, 4096), (32, 64), (16, 32), (33, 7), (3, 65), (5,)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = {2: torch.int16, 4: torch.int32}[a.dtype.itemsize]
    return torch.equal(a.view(bits), b.view(bits))


def dequantize_case(shape, dtype, device) -> dict:
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    packed, absmax = quantize_nf4(weight)
    want = dequantize_nf4(packed, absmax, shape, dtype)
    packed_gpu, absmax_gpu = packed.to(device), absmax.to(device)
    got = dequantize_nf4(packed_gpu, absmax_gpu, shape, dtype).cpu()
    layer_path = dequantize(packed_gpu, absmax_gpu, shape, dtype).cpu()
    return {
        "shape": list(shape),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_ops_equal": same_bits(got, want),
        "layer_path_equal": same_bits(layer_path, want),
    }


def layer_case(device, dtype=torch.bfloat16) -> dict:
    torch.manual_seed(0)
    layer = NF4Linear.from_linear(torch.nn.Linear(4096, 1024, dtype=dtype)).to(device)
    x = torch.randn(4, 256, 4096, device=device, dtype=dtype, requires_grad=True)
    out = layer(x)
    out.backward(torch.ones_like(out))
    weight = dequantize_nf4(layer.packed_weight, layer.absmax, (1024, 4096), dtype)
    x_ref = x.detach().clone().requires_grad_()
    want = F.linear(x_ref, weight) + layer.bias
    want.backward(torch.ones_like(want))
    grad_error = ((x.grad - x_ref.grad).abs().max() / x_ref.grad.abs().max()).item()
    return {
        "layer_forward_equal": torch.equal(out, want),
        "layer_input_grad_close": grad_error < 1e-2,  # the same product, maybe another kernel
        "layer_input_grad_rel_error": grad_error,
    }


def throughput(device) -> float:
    """Dequantized GB (bf16) a second, for a 14336 × 4096 weight."""
    packed, absmax = quantize_nf4(torch.randn(14336, 4096))
    packed, absmax = packed.to(device), absmax.to(device)
    for _ in range(3):
        dequantize_nf4(packed, absmax, (14336, 4096), torch.bfloat16)
    torch.cuda.synchronize(device)
    start, runs = time.perf_counter(), 20
    for _ in range(runs):
        dequantize_nf4(packed, absmax, (14336, 4096), torch.bfloat16)
    torch.cuda.synchronize(device)
    return runs * 14336 * 4096 * 2 / (time.perf_counter() - start) / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    device = torch.device(parser.parse_args().device)
    cases = [dequantize_case(s, d, device) for s in SHAPES for d in DTYPES]
    layer = layer_case(device)
    failed = [c for c in cases if not (c["torch_ops_equal"] and c["layer_path_equal"])]
    ok = not failed and layer["layer_forward_equal"] and layer["layer_input_grad_close"]
    cuda = device.type == "cuda"
    report = {
        "ok": ok,
        "device": torch.cuda.get_device_name(device) if cuda else str(device),
        "checked": len(cases),
        "failed": failed,
        **layer,
        "dequantize_gb_per_s": round(throughput(device), 1) if cuda else None,
    }
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

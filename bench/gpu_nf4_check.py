"""GPU check of the NF4 base weights: CUDA dequantizes bit for bit as the CPU does.

Usage: python3 bench/gpu_nf4_check.py [--device cuda:0] (``--device cpu``: a dry run
of the script itself). Needs torch with CUDA only
(no bitsandbytes: where it is installed, its kernel, which ``NF4Linear`` then uses on
CUDA, is compared too). For several shapes and dtypes (rows shorter than a block,
partial last blocks, odd counts, a weight larger than one dequantize chunk): the
bytes quantized on the host, dequantized on the GPU with the torch ops, equal the CPU
dequantize bit for bit; ``NF4Linear`` on the GPU gives ``F.linear`` over that weight
and the input gradient of its backward. Prints one JSON line (``ok``, the cases,
dequantize throughput) and exits 1 on any mismatch. Then Qwen3-MoE's stacked experts in
NF4 (needs transformers): the GPU's dequantized stack against the CPU's, and
transformers' experts forward and backward against dense dequantized weights.
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


def experts_case(device, dtype=torch.bfloat16) -> dict:
    """Qwen3-MoE's stacked experts in NF4 (``roundpipe.hf.nf4_experts``) on the GPU: the
    dequantized stack equals the CPU's bit for bit, and a forward and backward through
    transformers' own experts forward (``grouped_mm`` and ``eager``) match the same
    forward over the dense dequantized weights."""
    try:
        import transformers
        from transformers.models.qwen3_moe import modeling_qwen3_moe

        from roundpipe.hf.nf4_experts import quantize_experts_module
    except ImportError as exc:  # reported, not fatal: the layer checks above still count
        return {"experts_skipped": str(exc)}
    config = transformers.Qwen3MoeConfig(
        hidden_size=256, moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    dense = modeling_qwen3_moe.Qwen3MoeExperts(config).to(dtype)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0.0, 0.02)
    module = quantize_experts_module(dense)
    cpu_stack = {n: module.dequantized(n) for n in module._nf4_weights}
    module = module.to(device)
    equal = all(same_bits(module.dequantized(n).cpu(), w) for n, w in cpu_stack.items())
    tokens = 64
    x = torch.randn(tokens, config.hidden_size, device=device, dtype=dtype)
    top = torch.randint(0, config.num_experts, (tokens, 2), device=device)
    weights = torch.rand(tokens, 2, device=device, dtype=dtype)
    errors = {}
    for implementation in ("grouped_mm", "eager"):
        config._experts_implementation = implementation
        xq = x.clone().requires_grad_()
        out = module(xq, top, weights)
        out.float().sum().backward()
        reference = modeling_qwen3_moe.Qwen3MoeExperts(config).to(device, dtype)
        with torch.no_grad():
            for n, w in cpu_stack.items():
                getattr(reference, n).copy_(w.to(device))
        xr = x.clone().requires_grad_()
        want = reference(xr, top, weights)
        want.float().sum().backward()
        scale = want.abs().max().item() or 1.0
        errors[implementation] = max(
            (out - want).abs().max().item() / scale,
            (xq.grad - xr.grad).abs().max().item() / (xr.grad.abs().max().item() or 1.0),
        )
    return {
        "experts_dequantize_equal": equal,
        "experts_rel_error": errors,
        "experts_close": all(e < 1e-2 for e in errors.values()),
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
    try:
        experts = experts_case(device)
    except Exception as exc:  # noqa: BLE001 - reported in the JSON line, and not ok
        experts = {"experts_error": repr(exc), "experts_close": False}
    failed = [c for c in cases if not (c["torch_ops_equal"] and c["layer_path_equal"])]
    ok = not failed and layer["layer_forward_equal"] and layer["layer_input_grad_close"]
    ok = ok and experts.get("experts_close", True) and experts.get("experts_dequantize_equal", True)
    cuda = device.type == "cuda"
    report = {
        "ok": ok,
        "device": torch.cuda.get_device_name(device) if cuda else str(device),
        "checked": len(cases),
        "failed": failed,
        **layer,
        **experts,
        "dequantize_gb_per_s": round(throughput(device), 1) if cuda else None,
    }
    print(json.dumps(report), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Host optimizer path: gradient accumulation, AdamW step and weight publish vs memcpy.

Builds a :class:`~roundpipe.runtime.params.ParameterStore` over bf16 model weights
(``--params`` elements in ``--tensors`` tensors, fp32 masters) and times the
runtime's own code for each phase of the host side of a training step:

- ``accumulate``: ``ParameterStore.accumulate_grad`` of a bf16 gradient into the
  existing fp32 master gradient (10 B/param: read 2 + read 4 + write 4);
- ``adamw``: one ``torch.optim.AdamW(fused=True)`` step on the masters (28 B/param:
  read param, grad, exp_avg, exp_avg_sq, write param, exp_avg, exp_avg_sq);
- ``publish``: ``WeightVersions.publish`` of the masters into the bf16 spare
  upload buffers (6 B/param: read 4 + write 2);

and, for reference, outside the total: ``accumulate_first`` (the first gradient of a
step, which allocates the master gradient: 6 B/param) and ``accumulate_old`` (the
formula ``accumulate_grad`` used before it was fused: convert, divide, add through
a full-size temporary; counted at the same 10 B/param); and the lean optimizers of
``roundpipe.optim.make_adamw`` (docs/design.md#host-memory), each a step over the same
masters and gradients, with its parameters/s and its ratio to the ``adamw`` phase:
``adamw8bit`` (8-bit moments: read param 4, grad 4, codes 2, write param 4, codes 2),
``adamw_bf16_states`` (bf16 moments: 20 B/param) and ``adamw8bit_bf16_sr`` (bf16
masters, a copy of the weights, with 8-bit moments and stochastic rounding: 10 B/param
plus the random bits). ``--shapes qwen3`` steps Qwen3-1.7B-shaped 2-D weights instead
(``--layers`` decoder layers, embedding and head; ``--params``/``--tensors`` unused).
Each is compared with a ``dst.copy_(src)`` of a ~1 GiB fp32 tensor measured in the
same run (read + write bytes). Every figure is the median of 5 iterations after 1
warm-up; an iteration runs all phases in turn, so a load spike on a shared machine
hits them alike.

    .venv/bin/python bench/host_optimizer.py [--params 250000000] [--tensors 60]
        [--shapes flat|qwen3] [--layers 4] [--no-lean] [--scale 65536] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from roundpipe.runtime.layers import LayerBinding
from roundpipe.runtime.params import ParameterStore, _reference_grad
from roundpipe.runtime.versions import SPARE, WeightVersions

BYTES_PER_PARAM = {
    "accumulate": 10,
    "adamw": 28,
    "publish": 6,
    "accumulate_first": 6,
    "accumulate_old": 10,
    "adamw8bit": 16,
    "adamw_bf16_states": 20,
    "adamw8bit_bf16_sr": 10,
}
TOTAL = ("accumulate", "adamw", "publish")
LEAN = ("adamw8bit", "adamw_bf16_states", "adamw8bit_bf16_sr")
QWEN3_LAYER = [(2048, 2048), (1024, 2048), (1024, 2048), (2048, 2048)]  # q, k, v, o
QWEN3_LAYER += [(8192, 2048), (8192, 2048), (2048, 8192), (2048,), (2048,), (128,), (128,)]
MEMCPY_ELEMENTS = 1 << 28  # 1 GiB of fp32


def qwen3_shapes(layers: int) -> list[tuple[int, ...]]:
    """Qwen3-1.7B's weight shapes: embedding, ``layers`` decoder layers, norm, head."""
    return [(16384, 2048), *QWEN3_LAYER * layers, (2048,), (16384, 2048)]


def build(
    params: int, tensors: int, shapes: list[tuple[int, ...]] | None = None
) -> tuple[ParameterStore, list[int], list[torch.Tensor]]:
    layer = nn.Module()
    if shapes is None:
        shapes = [(params // tensors + (i < params % tensors),) for i in range(tensors)]
    sizes = shapes
    for i, size in enumerate(sizes):
        weight = torch.empty(size, dtype=torch.bfloat16).normal_(0.0, 0.02)
        layer.register_parameter(f"w{i}", nn.Parameter(weight))
    store = ParameterStore([LayerBinding(0, "bench", layer)], {}, None, pin=lambda t: t)
    store.ensure_masters()
    uids = list(store.entries)
    grads = [torch.empty(size, dtype=torch.bfloat16).normal_(0.0, 1e-3) for size in sizes]
    return store, uids, grads


def make_adamw(masters: list[nn.Parameter]) -> tuple[torch.optim.Optimizer, str]:
    try:
        optimizer = torch.optim.AdamW(masters, lr=1e-4, fused=True)
        kind = "fused"
    except (RuntimeError, ValueError) as error:  # fused unavailable on this build
        print(f"AdamW(fused=True) unavailable ({error}); using foreach=True")
        return torch.optim.AdamW(masters, lr=1e-4, foreach=True), "foreach"
    return optimizer, kind


def lean_phases(masters: list[nn.Parameter], grads: list[torch.Tensor]) -> dict:
    """The steps of :data:`LEAN`: ``make_adamw`` over the masters (their gradients as
    they are) and over bf16 copies of them (the bf16 gradients)."""
    from roundpipe.optim import make_adamw

    int8 = make_adamw(masters, lr=1e-4, states="int8")
    bf16_states = make_adamw(masters, lr=1e-4, states="bf16")
    copies = [nn.Parameter(m.detach().bfloat16()) for m in masters]
    for copy, grad in zip(copies, grads, strict=True):
        copy.grad = grad.view(copy.shape)
    bf16_sr = make_adamw(copies, lr=1e-4, states="int8", stochastic_round=True, seed=0)
    phases = {
        "adamw8bit": int8.step,
        "adamw_bf16_states": bf16_states.step,
        "adamw8bit_bf16_sr": bf16_sr.step,
    }
    return phases, int8


def quantized_fraction(optimizer: torch.optim.Optimizer) -> float:
    """The share of parameters whose moments are 8-bit (torchao quantizes a tensor of
    >= 4096 values that its block size divides; the rest keep fp32 moments)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    quantized = sum(
        p.numel() for p in params if type(optimizer.state[p]["exp_avg"]).__name__ != "Tensor"
    )
    return quantized / sum(p.numel() for p in params)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=250_000_000)
    parser.add_argument("--tensors", type=int, default=60)
    parser.add_argument(
        "--scale", type=float, default=None, help="loss scale to unscale by (default: none)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", choices=("flat", "qwen3"), default="flat")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of --shapes qwen3")
    parser.add_argument("--no-lean", action="store_true", help="skip the lean optimizer phases")
    args = parser.parse_args()

    shapes = qwen3_shapes(args.layers) if args.shapes == "qwen3" else None
    store, uids, grads = build(args.params, args.tensors, shapes)
    masters = [master for _, master in store.masters()]
    if shapes is not None:
        args.params = sum(m.numel() for m in masters)
        args.tensors = len(masters)
    for uid, grad in zip(uids, grads, strict=True):
        store.accumulate_grad(uid, grad, args.scale)  # the master gradients exist
    optimizer, adam_kind = make_adamw(masters)
    versions = WeightVersions(store, pin=lambda t: t)
    src = torch.ones(MEMCPY_ELEMENTS)
    dst = torch.zeros(MEMCPY_ELEMENTS)

    def memcpy() -> None:
        dst.copy_(src)

    def accumulate_first() -> None:
        for master in masters:
            master.grad = None
        for uid, grad in zip(uids, grads, strict=True):
            store.accumulate_grad(uid, grad, args.scale)

    def accumulate() -> None:
        for uid, grad in zip(uids, grads, strict=True):
            store.accumulate_grad(uid, grad, args.scale)

    def accumulate_old() -> None:
        for master, grad in zip(masters, grads, strict=True):
            master.grad.add_(_reference_grad(grad, torch.float32, args.scale))

    version = 0

    def adamw() -> None:
        optimizer.step()

    def publish() -> None:
        nonlocal version
        version += 1
        versions.publish(version, SPARE)

    phases = {
        "memcpy": memcpy,
        "accumulate_first": accumulate_first,
        "accumulate": accumulate,
        "accumulate_old": accumulate_old,
        "adamw": adamw,
        "publish": publish,
    }
    int8 = None
    if not args.no_lean:
        lean, int8 = lean_phases(masters, grads)
        phases.update(lean)
    times: dict[str, list[float]] = {name: [] for name in phases}
    with torch.no_grad():
        for iteration in range(1 + args.repeats):
            for name, phase in phases.items():
                start = time.perf_counter()
                phase()
                elapsed = time.perf_counter() - start
                if iteration > 0:
                    times[name].append(elapsed)

    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    memcpy_gbps = 2 * 4 * MEMCPY_ELEMENTS / seconds["memcpy"] / 1e9
    rows = {}
    for name, bpp in BYTES_PER_PARAM.items():
        if name not in seconds:
            continue
        gbps = bpp * args.params / seconds[name] / 1e9
        rows[name] = {
            "seconds": seconds[name],
            "bytes_per_param": bpp,
            "gbps": gbps,
            "of_memcpy": gbps / memcpy_gbps,
        }
    for name in LEAN:
        if name in rows:
            rows[name]["params_per_s"] = args.params / seconds[name]
            rows[name]["of_adamw"] = seconds["adamw"] / seconds[name]
    if int8 is not None:
        rows["adamw8bit"]["quantized_fraction"] = quantized_fraction(int8)
    total_s = sum(seconds[name] for name in TOTAL)
    total_bpp = sum(BYTES_PER_PARAM[name] for name in TOTAL)
    total_gbps = total_bpp * args.params / total_s / 1e9
    rows["total"] = {
        "seconds": total_s,
        "bytes_per_param": total_bpp,
        "gbps": total_gbps,
        "of_memcpy": total_gbps / memcpy_gbps,
    }
    result = {
        "params": args.params,
        "tensors": args.tensors,
        "scale": args.scale,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "adamw": adam_kind,
        "shapes": args.shapes,
        "repeats": args.repeats,
        "memcpy": {"seconds": seconds["memcpy"], "gbps": memcpy_gbps},
        "phases": rows,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.params:,} params in {args.tensors} tensors, bf16 weights, fp32 masters, "
        f"scale {args.scale}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"AdamW {adam_kind}; median of {args.repeats} after 1 warm-up"
    )
    print(f"memcpy (copy_ of 1 GiB fp32, read + write): {memcpy_gbps:.2f} GB/s")
    print(f"{'phase':18s} {'seconds':>8s} {'B/param':>8s} {'GB/s':>7s} {'of memcpy':>10s}")
    for name in (*TOTAL, "total", "accumulate_first", "accumulate_old"):
        row = rows[name]
        print(
            f"{name:18s} {row['seconds']:8.3f} {row['bytes_per_param']:8d} "
            f"{row['gbps']:7.2f} {row['of_memcpy']:9.0%}"
        )
    lean = [name for name in LEAN if name in rows]
    if lean:
        print(f"{'lean optimizer':18s} {'seconds':>8s} {'Mparam/s':>9s} {'of adamw':>9s}")
        adamw_rate = args.params / seconds["adamw"] / 1e6
        print(f"{'adamw (fused fp32)':18s} {seconds['adamw']:8.3f} {adamw_rate:9.1f} {1:9.0%}")
        for name in lean:
            row = rows[name]
            print(
                f"{name:18s} {row['seconds']:8.3f} {row['params_per_s'] / 1e6:9.1f} "
                f"{row['of_adamw']:9.0%}"
            )
        share = rows["adamw8bit"]["quantized_fraction"]
        print(f"8-bit moments for {share:.0%} of the parameters (the rest: fp32)")


if __name__ == "__main__":
    main()

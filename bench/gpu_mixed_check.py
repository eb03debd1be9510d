"""The GPU check's mixed-pool step: a few exact training steps on GPUs of different kinds.

On a machine with two or more GPUs of different models (``torch.cuda.get_device_name``),
trains a small MLP (no dropout) for three synchronous steps on all of them with the
automatic plan, and compares the losses and weights with the same steps in plain PyTorch
on the CPU (fp32, TF32 off); prints the pool's classes, the measured relative speeds
and the plan. On any other machine it prints why it is skipped and exits 0. The dry run
(``--devices emulated:2@1,0.5``) runs the same step on an emulated mixed pool.

    PYTHONPATH=. python bench/gpu_mixed_check.py                    # the GPUs here
    PYTHONPATH=. python bench/gpu_mixed_check.py --devices emulated:2@1,0.5
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig


def skipped_reason(spec: str) -> str | None:
    """Why this machine cannot run a mixed CUDA pool (None: it can)."""
    if not spec.startswith("cuda"):
        return None
    if not torch.cuda.is_available():
        return "no CUDA device"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    if len(set(names)) < 2:
        return f"needs two different GPUs, found {len(names)} x {names[0] if names else '-'}"
    return None


def model(width: int = 256, depth: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    body = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)]
    return nn.Sequential(*body, nn.Linear(width, 4))


def loss_fn(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, label, reduction="sum")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cuda")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    reason = skipped_reason(args.devices)
    if reason is not None:
        print(f"skipped: {reason}")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    net = model()
    reference = copy.deepcopy(net)
    torch.manual_seed(1)
    batches = [(torch.randn(32, 256), torch.randn(32, 4)) for _ in range(args.steps)]
    microbatches = 4
    config = RoundPipeRunConfig(num_microbatch=microbatches)
    with RoundPipe(net, devices=args.devices, model_run_config=config) as pipe:
        print("pool:", ", ".join(pipe.pool.device_classes()), "mixed:", pipe.pool.mixed)
        optimizer = torch.optim.SGD(pipe.optim_parameters(), lr=1e-3)
        losses = []
        for x, y in batches:
            losses.append(pipe.forward_backward((x,), label=y, loss_fn=loss_fn).item())
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
        pipe.synchronize()
        print("relative speeds:", pipe.runtime.profiler.relative_speeds())
        print("plan:", pipe.plan)
    want = []
    sgd = torch.optim.SGD(reference.parameters(), lr=1e-3)
    for x, y in batches:
        total = 0.0
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            loss = loss_fn(reference(xm), ym) / microbatches
            loss.backward()
            total += loss.item()
        want.append(total)
        sgd.step()
        sgd.zero_grad()
    worst = max(
        (a.detach().cpu() - b.detach()).abs().max().item()
        for a, b in zip(net.parameters(), reference.parameters(), strict=True)
    )
    print("losses:", [round(v, 6) for v in losses], "pytorch:", [round(v, 6) for v in want])
    print(f"largest weight difference: {worst:.2e}")
    close = all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for a, b in zip(losses, want, strict=True))
    if not close or worst > 1e-5:
        print("FAILED: the mixed pool does not train like PyTorch")
        return 1
    print("ok: the mixed pool trains like PyTorch")
    return 0


if __name__ == "__main__":
    sys.exit(main())

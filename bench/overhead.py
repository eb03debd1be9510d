"""RoundPipe's overhead on one emulated device against plain PyTorch.

Both sides train the same model on the same CPU over the same microbatches, with
one optimizer step per iteration:

- RoundPipe: ``devices="emulated:1"``, a fixed microbatch count, synchronous step;
- PyTorch: every layer wrapped in ``torch.utils.checkpoint`` (full activation
  recomputation, as RoundPipe does), the sum of microbatch losses, one step.

After warm-up the runs alternate (A, B, A, B, ...) so drift on a shared machine
hits both alike; the medians and their ratio RoundPipe / PyTorch are printed.
``--plan`` may be given several times (``PLAN@layer``: with layer-grain recompute):
each plan trains its own copy, all alternating with PyTorch in one process.
``--cpu`` adds where RoundPipe's CPU time goes: per thread, CPU milliseconds per step
during its timed steps (Linux: read from ``/proc/self/task``). ``--ops`` adds, after
them, what the emulated device's executor spent per op kind: how long the closures
ran and the CPU they used (less when the thread waited for the interpreter lock or a
core), per step and per op.

    .venv/bin/python bench/overhead.py --repeats 7
    .venv/bin/python bench/overhead.py --plan "12|1,1,1,1,1,1,1,1,1,1,1,1,1" --cpu
    .venv/bin/python bench/overhead.py --plan "12|1,12" --plan "12|1,12@layer"
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from roundpipe import RoundPipe, RoundPipeRunConfig


class Block(nn.Module):
    """A pre-norm residual MLP block, the shape of a transformer layer's feed-forward half."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build_model(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width) for _ in range(layers)), nn.Linear(width, 1))


def mse_sum(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target, reduction="sum")


def roundpipe_step(pipe: RoundPipe, lr: float) -> Callable[..., None]:
    """One synchronous RoundPipe training step, with the model's run config."""
    optimizer = torch.optim.Adam(pipe.optim_parameters(), lr=lr)

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad()

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        pipe.forward_backward((x,), label=y, loss_fn=mse_sum)
        pipe.step(update, is_async=False)

    return step


def pytorch_step(model: nn.Sequential, microbatches: int, lr: float) -> Callable[..., None]:
    """One plain PyTorch step: per-layer checkpointing, summed microbatch losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    *body, head = model

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True):
            h = xm
            for layer in body:
                h = checkpoint(layer, h, use_reentrant=False)
            mse_sum(checkpoint(head, h, use_reentrant=False), ym).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def timed(step: Callable[..., None], x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    step(x, y)
    return time.perf_counter() - start


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="residual MLP blocks")
    parser.add_argument("--width", type=int, default=128, help="hidden size")
    parser.add_argument("--batch", type=int, default=128, help="samples per step")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps of each")
    parser.add_argument("--repeats", type=int, default=9, help="timed steps of each")
    parser.add_argument(
        "--plan",
        action="append",
        help='pin a RoundPipe plan, e.g. "3|10,1,2" (default: auto); "PLAN@layer" recomputes '
        "layer by layer; repeat to compare plans in one run",
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: steady on a busy CPU)"
    )
    parser.add_argument(
        "--cpu", action="store_true", help="print RoundPipe's CPU time per thread (Linux)"
    )
    parser.add_argument(
        "--ops", action="store_true", help="print the device executor's time per op kind"
    )
    args = parser.parse_args()
    if (args.cpu or args.ops) and len(args.plan or []) > 1:
        parser.error("--cpu and --ops measure one plan: give --plan once")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.layers, args.width)
    with contextlib.ExitStack() as stack:
        steps, pipes = {}, {}
        specs = args.plan or [None]
        for spec in specs:
            plan, _, grain = (spec or "").partition("@")
            config = RoundPipeRunConfig(
                num_microbatch=args.microbatches,
                execute_plan=plan or None,
                recompute_grain=grain or "stage",
            )
            pipe = stack.enter_context(
                RoundPipe(copy.deepcopy(model), devices="emulated:1", model_run_config=config)
            )
            name = "roundpipe" if len(specs) == 1 else f"roundpipe {spec}"
            steps[name], pipes[name] = roundpipe_step(pipe, 1e-4), pipe
        steps["pytorch"] = pytorch_step(copy.deepcopy(model), args.microbatches, 1e-4)
        cpu: collections.Counter = collections.Counter()
        times = run_interleaved(steps, args, cpu if args.cpu else None)
        ops = measure_ops(pipes["roundpipe"], steps["roundpipe"], args) if args.ops else None
        plans = {name: pipe.plan for name, pipe in pipes.items()}
    report(times, args, plans)
    if args.cpu:
        report_cpu(cpu, args.repeats, times["pytorch"])
    if ops is not None:
        report_ops(ops, args.repeats)


def run_interleaved(
    steps: dict[str, Callable[..., None]],
    args: argparse.Namespace,
    cpu: collections.Counter | None = None,
) -> dict[str, list[float]]:
    """Warm up each, then time them alternately: A, B, A, B, ... With ``cpu``, add the
    CPU seconds each thread used during the timed RoundPipe steps (read outside them)."""
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, 1)
    for _ in range(args.warmup):
        for step in steps.values():
            step(x, y)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.repeats):
        for name, step in steps.items():
            before = thread_cpu_seconds() if cpu is not None and name == "roundpipe" else None
            times[name].append(timed(step, x, y))
            if before is not None:
                cpu.update({k: v - before.get(k, 0.0) for k, v in thread_cpu_seconds().items()})
    return times


def measure_ops(pipe: RoundPipe, step: Callable[..., None], args: argparse.Namespace) -> dict:
    """Run ``args.repeats`` more RoundPipe steps recording the executor's ops; per (stream,
    op kind): [count, seconds the closures ran, CPU seconds they used]."""
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, 1)
    pipe.start_timeline()
    for _ in range(args.repeats):
        step(x, y)
    totals: dict = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for span in pipe.pool.spans():
        entry = totals[(span.stream, span.info.kind)]
        entry[0] += 1
        entry[1] += span.ran
        entry[2] += span.cpu
    return totals


def report_ops(totals: dict, repeats: int) -> None:
    print(f"executor per step, by op ({repeats} steps; wall = closure ran, cpu = on a core):")
    print(f"  {'stream':14s} {'op':12s} {'ops':>6s} {'wall ms':>8s} {'cpu ms':>7s} {'us/op':>11s}")
    ran = cpu = 0.0
    for (stream, kind), (count, seconds, used) in sorted(totals.items(), key=lambda e: -e[1][1]):
        ran, cpu = ran + seconds, cpu + used
        per_op = f"{seconds / count * 1e6:.0f}/{used / count * 1e6:.0f}"
        print(
            f"  {stream:14s} {kind:12s} {count / repeats:6.1f} {seconds / repeats * 1e3:8.2f} "
            f"{used / repeats * 1e3:7.2f} {per_op:>11s}"
        )
    print(f"  {'total':27s} {'':6s} {ran / repeats * 1e3:8.2f} {cpu / repeats * 1e3:7.2f}")


def thread_cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) used so far by each live thread of this process, by
    thread name (Linux only: empty elsewhere)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = collections.defaultdict(float)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds[names.get(int(tid), f"thread {tid}")] += (int(fields[11]) + int(fields[12])) / tick
    return dict(seconds)


def report_cpu(cpu: collections.Counter, repeats: int, pytorch: list[float]) -> None:
    """Per thread, CPU ms per RoundPipe step (clock ticks: about ±10 ms / repeats)."""
    if not cpu:
        print("per-thread CPU time needs Linux's /proc")
        return
    print(
        f"roundpipe CPU per step by thread (pytorch: {statistics.mean(pytorch) * 1e3:.1f} ms wall):"
    )
    for name, seconds in cpu.most_common():
        if seconds > 0:
            print(f"  {name:40s} {seconds / repeats * 1e3:7.1f} ms")
    print(f"  {'total':40s} {sum(cpu.values()) / repeats * 1e3:7.1f} ms")


def report(times: dict[str, list[float]], args: argparse.Namespace, plans: dict) -> None:
    medians = {name: statistics.median(t) for name, t in times.items()}
    used = ", ".join(str(plan) for plan in plans.values())
    print(
        f"{args.layers} blocks x width {args.width}, batch {args.batch} in "
        f"{args.microbatches} microbatches, torch threads {torch.get_num_threads()}, "
        f"{args.repeats} interleaved runs each, roundpipe plan {used}"
    )
    width = max(len(name) for name in medians)
    for name, median in medians.items():
        spread = f"{min(times[name]) * 1e3:.1f}-{max(times[name]) * 1e3:.1f}"
        print(f"{name:>{width}}: median {median * 1e3:7.1f} ms/step  (range {spread} ms)")
    for name in plans:
        ratio = medians[name] / medians["pytorch"]
        print(f"ratio {name}/pytorch: {ratio:.3f}")


if __name__ == "__main__":
    main()

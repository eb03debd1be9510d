"""Short GPU throughput probe: RoundPipe against plain PyTorch on the same GPU(s).

Trains the example transformer (examples/train_tiny_lm.py) scaled up, for a few
steps each, and prints tokens/s of both and their ratio. On a one-GPU machine
RoundPipe runs several logical devices on that GPU ("cuda:0,0,..."), so the ratio
measures the runtime's overhead, not multi-GPU scaling.

    python bench/gpu_probe.py --devices cuda:0,0,0 --steps 10
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_tiny_lm import next_token_loss, tiny_lm  # noqa: E402

from roundpipe import RoundPipe, RoundPipeRunConfig  # noqa: E402


def batches(steps: int, batch: int, context: int, vocab: int):
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, vocab, (batch, context + 1), generator=generator) for _ in range(steps)
    ]


def plain_pytorch(args, data) -> float:
    model = tiny_lm(args.vocab, args.width, args.depth, args.heads, args.context).cuda()
    optimizer = torch.optim.Adam(model.parameters(), fused=True)
    for i, window in enumerate(data):
        if i == args.warmup:
            torch.cuda.synchronize()
            start = time.perf_counter()
        window = window.cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = next_token_loss(model(window[:, :-1]), window[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def roundpipe(args, data) -> float:
    model = tiny_lm(args.vocab, args.width, args.depth, args.heads, args.context)
    config = RoundPipeRunConfig(num_microbatch=args.microbatches)
    with RoundPipe(model, devices=args.devices, model_run_config=config) as pipe:
        optimizer = torch.optim.Adam(pipe.optim_parameters(), fused=True)
        for i, window in enumerate(data):
            if i == args.warmup:
                pipe.synchronize()
                start = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pipe.forward_backward(
                    (window[:, :-1],), label=window[:, 1:], loss_fn=next_token_loss
                )
            pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        pipe.synchronize()
        print(f"roundpipe plan {pipe.plan}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cuda:0,0,0")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args()
    data = batches(args.steps, args.batch, args.context, args.vocab)
    tokens = (args.steps - args.warmup) * args.batch * args.context
    plain = plain_pytorch(args, data)
    pipelined = roundpipe(args, data)
    print(f"plain PyTorch: {tokens / plain:10.0f} tokens/s")
    print(f"roundpipe:     {tokens / pipelined:10.0f} tokens/s  ({args.devices})")
    print(f"ratio roundpipe/plain (throughput): {plain / pipelined:.3f}")


if __name__ == "__main__":
    main()

"""Train a tiny character-level transformer with RoundPipe on emulated devices.

The corpus is the repository's own LICENSE file, so nothing is downloaded. Each step
prints the loss and the throughput; the loss falls within a few dozen steps.

    python examples/train_tiny_lm.py --devices emulated:4 --steps 40
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

from roundpipe import RoundPipe, RoundPipeRunConfig

CORPUS = Path(__file__).resolve().parent.parent / "LICENSE"


class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        causal = torch.triu(
            torch.ones(length, length, dtype=torch.bool, device=x.device), diagonal=1
        )
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.proj = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.norm(x))


def tiny_lm(vocab: int, width: int, depth: int, heads: int, context: int) -> nn.Sequential:
    blocks = [Block(width, heads) for _ in range(depth)]
    return nn.Sequential(Embed(vocab, width, context), *blocks, Head(width, vocab))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())  # mean per token


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="emulated:4")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=20)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--width", type=int, default=96)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--sync", action="store_true", help="synchronous optimizer steps")
    args = parser.parse_args()

    text = CORPUS.read_text()
    alphabet = sorted(set(text))
    data = torch.tensor([alphabet.index(c) for c in text])
    torch.manual_seed(0)
    model = tiny_lm(len(alphabet), args.width, args.depth, 4, args.context)
    with RoundPipe(model, devices=args.devices, model_run_config=RoundPipeRunConfig()) as pipe:
        optimizer = torch.optim.Adam(pipe.optim_parameters(), lr=args.lr, fused=True)

        def step_fn() -> None:
            optimizer.step()
            optimizer.zero_grad()

        print(f"{pipe.pool!r}, plan {pipe.plan}, {len(alphabet)} symbols, {len(data)} characters")
        start = time.perf_counter()
        for step in range(1, args.steps + 1):
            offsets = torch.randint(0, len(data) - args.context - 1, (args.batch,))
            window = torch.stack([data[o : o + args.context + 1] for o in offsets])
            loss = pipe.forward_backward(
                (window[:, :-1],), label=window[:, 1:], loss_fn=next_token_loss
            )
            pipe.step(step_fn, is_async=not args.sync)
            elapsed = time.perf_counter() - start
            print(
                f"step {step:3d}  loss/token {loss.item():.3f}  "
                f"{step * args.batch / elapsed:7.1f} samples/s"
            )
        pipe.synchronize()


if __name__ == "__main__":
    main()

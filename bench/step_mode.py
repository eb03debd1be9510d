"""Asynchronous against synchronous steps on fine-tuning as users do it.

A small model is first trained to convergence on one task (``roundpipe train --demo``:
the tiny Qwen3 chat model, full training, exact steps), then fine-tuned on another (a
synthetic arithmetic chat set written here): LoRA at lr 2e-4 and full at 2e-5, with the
default one-step-stale asynchronous steps and with ``--sync``, three seeds each. It
prints the final eval loss of every run and, per method, the mean over seeds of
async against sync. Every run is a ``roundpipe train`` subprocess on emulated devices.

    .venv/bin/python bench/step_mode.py [--steps 120] [--seeds 0,1,2] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"lora": ["--lr", "2e-4"], "full": ["--full", "--lr", "2e-5"]}


def arithmetic_chats(count: int, seed: int) -> list[dict]:
    """``count`` chats asking for a sum of two numbers below 50, answered in words the
    demo tokenizer knows ("The answer is 17.")."""
    rng = random.Random(seed)
    chats = []
    for _ in range(count):
        a, b = rng.randrange(50), rng.randrange(50)
        chats.append(
            {
                "messages": [
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"The answer is {a + b}."},
                ]
            }
        )
    return chats


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def roundpipe(*args: str) -> None:
    command = [sys.executable, "-m", "roundpipe", "train", *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")


def final_eval_loss(output: Path) -> float:
    rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
    return [row["eval_loss"] for row in rows if "eval_loss" in row][-1]


def two_tasks(work: Path) -> tuple[Path, Path, Path]:
    """Task A done and task B written under ``work``: the demo model trained to
    convergence on its chat set (kept between runs), and the arithmetic chats to
    fine-tune it on (512) and to evaluate it with (64). Returns (model, train, held out)."""
    base = work / "base"
    if not (base / "model.safetensors").exists():
        roundpipe("--demo", "--output", str(base))  # task A, to convergence
    train = write_jsonl(work / "sums.jsonl", arithmetic_chats(512, seed=1))
    held_out = write_jsonl(work / "sums_eval.jsonl", arithmetic_chats(64, seed=2))
    return base, train, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="roundpipe-step-mode-"))
    base, train, held_out = two_tasks(work)
    runs = []
    for method, flags in METHODS.items():
        for sync in (False, True):
            for seed in (int(s) for s in args.seeds.split(",")):
                output = work / f"{method}-{'sync' if sync else 'async'}-{seed}"
                if not (output / "metrics.jsonl").exists():
                    roundpipe(
                        "--model", str(base), "--data", str(train), "--eval-data",
                        str(held_out), "--output", str(output), "--steps", str(args.steps),
                        "--batch-size", "16", "--seq-len", "64", "--warmup-steps", "10",
                        "--eval-every", str(args.steps), "--seed", str(seed),
                        *flags, *(["--sync"] if sync else []),
                    )  # fmt: skip
                runs.append(
                    {
                        "method": method,
                        "sync": sync,
                        "seed": seed,
                        "eval_loss": final_eval_loss(output),
                    }
                )
                if not args.json:
                    print(f"{method:4} {'sync ' if sync else 'async'} seed {seed}: "
                          f"eval loss {runs[-1]['eval_loss']:.4f}", flush=True)  # fmt: skip
    summary = {}
    for method in METHODS:
        mean = {
            sync: statistics.mean(
                r["eval_loss"] for r in runs if (r["method"], r["sync"]) == (method, sync)
            )
            for sync in (False, True)
        }
        summary[method] = {
            "async": mean[False],
            "sync": mean[True],
            "ratio": mean[False] / mean[True],
        }
    if args.json:
        print(json.dumps({"runs": runs, "summary": summary, "steps": args.steps}))
    else:
        for method, row in summary.items():
            print(f"{method}: mean eval loss async {row['async']:.4f}, sync {row['sync']:.4f}, "
                  f"async/sync {row['ratio']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()

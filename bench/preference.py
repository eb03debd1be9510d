"""A LoRA-DPO step against a LoRA-SFT step on the same pairs: tokens/s and host RAM.

The model is a Qwen3 built in code (4 layers of width 256, vocabulary 8192, untied head,
fp32, random weights: no download) with LoRA adapters of rank 8 on every linear layer,
on ``devices="emulated:2"``, 4 microbatches a call. A batch is 8 pairs of 128 tokens
(a prompt of 64 shared by both completions, then 64 completion tokens), 16 rows, pairs
in adjacent rows:

- **sft**: ``pipe.forward_backward`` over the 16 rows (labels: the completion tokens)
  and a synchronous ``pipe.step`` (AdamW);
- **dpo**: ``roundpipe.preference.dpo_forward_backward`` over the 8 pairs, the
  reference being the same pipe with its adapters off (a forward-only pass over the
  16 rows), and the same step.

Tokens/s counts the policy's tokens, every token of the 16 rows, over the median step
time; the steps alternate (sft, dpo, sft, ...) after a warm-up so load on a shared
machine hits both alike. For context, ``roundpipe simulate --method dpo`` against
``--method sft`` on the same sequences (16 pairs against 32 sequences) predicts the
same ratio for 8x RTX 4090, seq 4096, ``--lora 16``, on Qwen3-8B and Qwen3-32B.

Host RAM: each method trains a few steps in a fresh child process; its peak resident
set (``VmHWM``) less its resident set once torch, transformers, peft and roundpipe are
imported, over the model's parameters (base and adapters). ``VmHWM`` is the child's own
peak; ``ru_maxrss`` is not: Linux carries the parent's resident set at the fork over
the ``exec``, so a child of this (large) process would report the parent's. The
emulated devices' memory (weights uploaded, activations, logits: a GPU's) lives in the
same resident set, so the child also samples, every 5 ms, the resident set less what
the devices hold (``bench/host_memory.py``'s ``Sampler``, layers' computed tensors
counted as device memory): the host's own peak. The children run with glibc's
``MALLOC_MMAP_THRESHOLD_`` at 64 KiB, so freed blocks go back to the kernel and the
peak is what was live (with the dynamic default the same run's peak varied by 15%). A
LoRA policy's reference is its own base with the adapters off, so DPO should need what
SFT needs (no reference copy: a ratio within 5% of 1; a deep copy of the model kept as
a reference gave 1.2).

    .venv/bin/python bench/preference.py            # 1-2 minutes on 2 cores
    .venv/bin/python bench/preference.py --quick    # a tiny model, ~30 s (a smoke test)
    .venv/bin/python bench/preference.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import host_memory  # bench/host_memory.py (the script's folder is on sys.path)

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")
METHODS = ("sft", "dpo")
DEFAULT = {"layers": 4, "width": 256, "vocab": 8192, "pairs": 8, "seq": 128, "steps": 3,
           "models": ["Qwen3-8B", "Qwen3-32B"]}  # fmt: skip
QUICK = {"layers": 2, "width": 64, "vocab": 512, "pairs": 2, "seq": 32, "steps": 1,
         "models": ["Qwen3-8B"]}  # fmt: skip
PREDICTED = ["--gpu", "rtx4090", "--gpus", "8", "--seq-len", "4096", "--lora", "16",
             "--host-ram", "256", "--schedule", "roundpipe", "--json"]  # fmt: skip
"""The predicted box and workload (``--host-ram``: a server's, not this machine's)."""
PREDICTED_PAIRS = 16
MMAP_THRESHOLD = 65536


def build_pipe(args: argparse.Namespace, devices="emulated:2"):
    """The LoRA Qwen3 of the docstring on ``devices``, its AdamW and its parameter count."""
    import peft
    import torch
    import transformers

    import roundpipe

    heads = max(1, args.width // 64)
    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.width, intermediate_size=3 * args.width,
        num_hidden_layers=args.layers, num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2), head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float()
    lora = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    model = peft.get_peft_model(model, lora).train()
    run_config = roundpipe.RoundPipeRunConfig(num_microbatch=4)
    pipe = roundpipe.from_hf(model, devices=devices, model_run_config=run_config)
    optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-4)
    return pipe, optimizer, sum(p.numel() for p in model.parameters())


def pair_rows(args: argparse.Namespace) -> dict:
    """``args.pairs`` pairs of random tokens in adjacent rows: chosen and rejected share
    a prompt of half the sequence; labels are the completion tokens."""
    import torch

    generator = torch.Generator().manual_seed(0)
    prompt = args.seq // 2
    ids = torch.randint(0, args.vocab, (2 * args.pairs, args.seq), generator=generator)
    ids[1::2, :prompt] = ids[0::2, :prompt]
    labels = ids.clone()
    labels[:, :prompt] = -100
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def train_step(pipe, optimizer, rows: dict, method: str) -> None:
    """One synchronous ``method`` step over ``rows``."""
    from roundpipe.preference import dpo_forward_backward

    def update() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if method == "sft":
        pipe.forward_backward(input_kwargs=rows)
    else:
        dpo_forward_backward(pipe, rows)  # the reference: the adapters off
    pipe.step(update, is_async=False)


def measure_speed(args: argparse.Namespace) -> dict:
    """Median seconds of each method's step, alternating on one pipe."""
    pipe, optimizer, params = build_pipe(args)
    rows = pair_rows(args)
    times: dict[str, list[float]] = {method: [] for method in METHODS}
    with pipe:
        for method in METHODS:  # warm-up: plans, first uploads, the optimizer's state
            train_step(pipe, optimizer, rows, method)
        for _ in range(args.steps):
            for method in METHODS:
                start = time.perf_counter()
                train_step(pipe, optimizer, rows, method)
                times[method].append(time.perf_counter() - start)
    tokens = rows["input_ids"].numel()
    result = {"params": params, "tokens_per_step": tokens}
    for method in METHODS:
        seconds = statistics.median(times[method])
        result[method] = {"step_s": seconds, "tokens_per_s": tokens / seconds,
                          "steps_s": times[method]}  # fmt: skip
    result["ratio"] = result["dpo"]["tokens_per_s"] / result["sft"]["tokens_per_s"]
    return result


def predicted_ratio(model: str) -> dict:
    """``roundpipe simulate``'s tokens/s of DPO (``PREDICTED_PAIRS`` pairs) and of SFT
    over the same sequences (twice as many), and their ratio."""
    tokens = {}
    for method, batch in (("sft", 2 * PREDICTED_PAIRS), ("dpo", PREDICTED_PAIRS)):
        command = [sys.executable, "-m", "roundpipe", "simulate", "--model", model,
                   "--method", method, "--batch", str(batch), *PREDICTED]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
        row = json.loads(done.stdout.splitlines()[0])
        tokens[method] = row["tokens_per_s"]
    return {"model": model, **tokens, "ratio": tokens["dpo"] / tokens["sft"]}


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def peak_rss_bytes() -> int:
    """This process's peak resident set (``VmHWM``; see the docstring on ``ru_maxrss``)."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024  # kB


def memory_worker(args: argparse.Namespace) -> dict:
    """In this (fresh) process: ``args.worker``'s steps, and its peaks over what the
    imports left (the resident set's, and the host's own: less the devices')."""
    import peft  # noqa: F401  (imported before the baseline, as the others)
    import torch
    import transformers  # noqa: F401

    import roundpipe.preference  # noqa: F401
    from roundpipe.devices import EmulatedDevicePool, EmulatedOptions

    torch.set_num_threads(args.threads)
    baseline = rss_bytes()
    sampler = host_memory.Sampler()
    host_baseline = sampler.sample()
    pool = EmulatedDevicePool(2, EmulatedOptions(count_compute_memory=True))
    pipe, optimizer, params = build_pipe(args, devices=pool)
    sampler.devices = list(pool.devices)
    rows = pair_rows(args)
    with pipe:
        for _ in range(args.steps + 1):
            train_step(pipe, optimizer, rows, args.worker)
    sampler.stop()
    pool.close()
    peak = peak_rss_bytes()
    return {"method": args.worker, "params": params, "baseline_bytes": baseline,
            "peak_bytes": peak - baseline, "bytes_per_param": (peak - baseline) / params,
            "host_peak_bytes": sampler.peak - host_baseline,
            "host_bytes_per_param": (sampler.peak - host_baseline) / params}  # fmt: skip


def measure_memory(args: argparse.Namespace, method: str) -> dict:
    command = [sys.executable, __file__, "--worker", method, *sizes(args)]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"the {method} memory run failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def sizes(args: argparse.Namespace) -> list[str]:
    """The flags that give a child process this run's model, rows and steps."""
    flags = []
    for name in ("layers", "width", "vocab", "pairs", "seq", "steps", "threads"):
        flags += [f"--{name}", str(getattr(args, name))]
    return flags


def print_table(args: argparse.Namespace, result: dict) -> None:
    speed = result["speed"]
    print(
        f"model: Qwen3, {args.layers} layers of width {args.width}, vocabulary {args.vocab}, "
        f"{speed['params'] / 1e6:.2f} M params, fp32, LoRA r 8 (all linear); emulated:2, "
        f"{args.pairs} pairs of {args.seq} tokens ({2 * args.pairs} rows), 4 microbatches, "
        f"torch threads {args.threads}, median of {args.steps} steps"
    )
    print(f"{'step':<6} {'ms/step':>9} {'tokens/s':>10}")
    for method in METHODS:
        row = speed[method]
        print(f"{method:<6} {row['step_s'] * 1e3:>9.1f} {row['tokens_per_s']:>10.1f}")
    print(f"dpo/sft tokens/s: {speed['ratio']:.3f} (emulated)")
    print(
        f"\npredicted (roundpipe simulate, 8x rtx4090, seq 4096, --lora 16, --host-ram 256): "
        f"dpo --batch {PREDICTED_PAIRS} pairs against sft --batch {2 * PREDICTED_PAIRS}"
    )
    print(f"{'model':<10} {'sft tok/s':>10} {'dpo tok/s':>10} {'dpo/sft':>8}")
    for row in result["predicted"]:
        print(f"{row['model']:<10} {row['sft']:>10.0f} {row['dpo']:>10.0f} {row['ratio']:>8.3f}")
    print("\nhost RAM per parameter of the model: peak RSS less RSS after imports; host: "
          "less what the emulated devices hold")  # fmt: skip
    print(f"{'method':<6} {'RSS MiB':>8} {'bytes/param':>12} {'host MiB':>9} {'bytes/param':>12}")
    for method in METHODS:
        row = result["memory"][method]
        print(
            f"{method:<6} {row['peak_bytes'] / 2**20:>8.1f} {row['bytes_per_param']:>12.2f} "
            f"{row['host_peak_bytes'] / 2**20:>9.1f} {row['host_bytes_per_param']:>12.2f}"
        )
    ratios = result["memory_ratio"]
    print(f"dpo/sft: RSS {ratios['rss']:.3f}, host {ratios['host']:.3f} (goal: within 5% of 1)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model and batch")
    for name, value in DEFAULT.items():
        if name != "models":
            help = f"(default {value}; --quick {QUICK[name]})"
            parser.add_argument(f"--{name}", type=int, default=None, help=help)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--json", action="store_true", help="one JSON object")
    parser.add_argument("--worker", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    setting = QUICK if args.quick else DEFAULT
    for name, value in setting.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    if args.worker:
        print(json.dumps(memory_worker(args)))
        return
    import torch

    torch.set_num_threads(args.threads)
    result = {"speed": measure_speed(args)}
    result["predicted"] = [predicted_ratio(model) for model in args.models]
    result["memory"] = {method: measure_memory(args, method) for method in METHODS}
    memory = result["memory"]
    result["memory_ratio"] = {
        "rss": memory["dpo"]["bytes_per_param"] / memory["sft"]["bytes_per_param"],
        "host": memory["dpo"]["host_bytes_per_param"] / memory["sft"]["host_bytes_per_param"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_table(args, result)


if __name__ == "__main__":
    main()

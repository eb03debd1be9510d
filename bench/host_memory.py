"""Host memory per parameter of a fine-tune, measured, and where the bytes go.

A Qwen3-shaped decoder of ~320 M parameters (4 layers of width 2048, vocabulary 16384,
untied head; built in code from a ``transformers`` config, bf16, random weights: no
download) is fine-tuned for a few steps on random tokens (2 sequences of 64 tokens, 2
microbatches) with ``roundpipe.from_hf(..., devices="emulated:2")`` and AdamW, once per
configuration of :data:`CONFIGS`, each in a fresh subprocess so that the RSS one leaves
behind does not count for the next.

What is counted. Host memory is what the process holds beyond what the emulated devices
hold (they stand for GPU memory): the resident set (``/proc/self/statm``) minus the sum
of ``memory_allocated()`` over ``pipe.pool``'s devices, which counts every block a
device allocated (weights, uploads, activations, what autograd saves) until the block
is free for reuse, and what layers compute (``count_compute_memory``: activations and a
stage's weight gradients, while a call runs) until it dies
(roundpipe/devices/emulated/memory.py). The baseline is the same
figure just before the model is built (interpreter, torch, transformers and roundpipe
imported), so the model's own bf16 weights count.

- ``bytes_per_param``: the steady state, taken on the optimizer thread at the start of
  the last step (every gradient of the step's calls is in, the masters, the spare upload
  buffers and the Adam moments exist since the first step, nothing is freed yet) minus
  the baseline, over the trainable parameters (for LoRA: the adapters; see
  ``bytes_per_model_param`` for the figure over all parameters).
  With steps in backward (``int8-backward``: no step after the backward) it is the
  largest figure any post-accumulate-grad hook of the last call saw on entry, and
  ``grads`` and ``download_cache`` are the bytes of master gradients and of download
  blocks held at that moment (measured).
- ``peak_bytes_per_param``: the largest host figure a background thread saw (sampling
  every 5 ms from before the model is built to the end), minus the baseline, over the
  trainable parameters. It includes transients: the model's construction, the first
  step creating the moments, the fused AdamW step's temporaries.

Freed memory that the C allocator keeps (a freed device block or gradient that glibc does
not return to the kernel) still counts: it is what the process holds. How much of it
glibc would give back is measured once, at the last step, just after the steady figure:
``trimmable_bytes`` is the steady figure less the one after ``malloc_trim(0)``. Each RSS
sample is read before the device figure, so a block allocated in between is counted on
the device side (the peak errs low, not high); a block freed on a device but waiting for
other streams still counts there.

The expected components are computed from the parameters: ``weights`` (every parameter
in the model dtype: the user's tensors, uploaded in the home version), ``spare`` (the
second upload buffer of every trainable parameter, which asynchronous steps publish into),
``masters``, ``grads`` (the fp32 master copies and their accumulated gradients) and
``moments`` (AdamW's two per master), plus ``download_cache``: the page-locked download
blocks the pool held at the steady point (measured, ``pool.host_blocks``). ``other`` is
the measured total less all of these (allocator slack, of which ``trimmable`` is what
``malloc_trim`` returns, activations and gradients in host memory on their way, Python
objects).

    .venv/bin/python bench/host_memory.py              # a table, ~2-3 minutes on 2 cores
    .venv/bin/python bench/host_memory.py --json       # one JSON object per configuration
    .venv/bin/python bench/host_memory.py --config full-sync --steps 4
    .venv/bin/python bench/host_memory.py --mmap-threshold 65536   # freed memory given back
    .venv/bin/python bench/host_memory.py --layers 16 --width 1024  # as many params, smaller stages

With glibc's default (a dynamic mmap threshold that grows to 32 MiB), memory freed by
one step's transients stays in the heap (``trimmable``); here that includes the
emulated devices' memory, which lives in host ``malloc`` blocks (a GPU process's device
memory is not in its RSS). ``--mmap-threshold 65536`` sets glibc's
``MALLOC_MMAP_THRESHOLD_`` in the runs, so freed blocks of 64 KiB or more go back to the
kernel at once and the figures are what is live (plus small-block slack).

The lean configurations keep the masters in the model's dtype (``optim_dtype=torch.bfloat16``:
the masters are the model's own weights) and AdamW's moments in bf16 or 8 bits
(``roundpipe.optim.make_adamw``); synchronous steps need no spare buffer. A new
configuration is one more entry in :data:`CONFIGS`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = os.sysconf("SC_PAGE_SIZE")
LIBC = ctypes.CDLL("libc.so.6")
SAMPLE_S = 0.005


@dataclass(frozen=True)
class Config:
    """One way to fine-tune the model: what :func:`measure` varies."""

    description: str
    lora: bool = False
    """Train LoRA adapters (rank 16, alpha 32, all linear layers; peft's fp32 adapters)
    on the frozen bf16 model, as ``roundpipe train`` does by default, instead of every
    weight."""
    is_async: bool = False
    """``pipe.step(..., is_async=True)``: one-step-stale asynchronous steps, which write
    one version while calls read the other (a spare upload buffer per trainable
    parameter is expected; synchronous steps write the weights in place)."""
    pipe_options: dict = field(default_factory=dict)
    """More keyword arguments of ``roundpipe.from_hf`` (e.g. ``optim_dtype``)."""
    optimizer: dict | None = None
    """Keyword arguments of ``roundpipe.optim.make_adamw`` (``states``,
    ``stochastic_round``); None: ``torch.optim.AdamW(fused=True)``."""
    master_bytes: float = 4
    """Bytes per element of a master copy (expected; 0: the masters are the weights)."""
    grad_bytes: float = 4
    """Bytes per element of a master's accumulated gradient (expected)."""
    moment_bytes: float = 4
    """Bytes per element of each of AdamW's two moments (expected; int8: one byte and
    an fp32 scale per block of 256)."""
    in_backward: bool = False
    """Steps in backward: one ``make_adamw`` per master, stepped by its post-accumulate-grad
    hook as soon as its gradient is in (no step after the backward, no clipping)."""


BF16_MASTERS = {"optim_dtype": "bfloat16"}
INT8 = {
    "pipe_options": BF16_MASTERS,
    "optimizer": {"states": "int8", "stochastic_round": True},
    "master_bytes": 0,
    "grad_bytes": 2,
    "moment_bytes": 1 + 4 / 256,
}
"""What the 8-bit configurations share: bf16 masters (the weights), torchao-format 8-bit
moments (a byte and an fp32 scale per 256), stochastic rounding."""
CONFIGS: dict[str, Config] = {
    "full-sync": Config("full AdamW, bf16 model, fp32 masters, sync steps"),
    "full-async": Config("full AdamW, bf16 model, fp32 masters, async steps", is_async=True),
    "lora-sync": Config("LoRA r16 all-linear, bf16 base, sync steps", lora=True),
    "bf16-sync": Config(
        "full AdamW, bf16 masters (the weights), bf16 moments, stochastic rounding, sync",
        pipe_options=BF16_MASTERS,
        optimizer={"states": "bf16", "stochastic_round": True},
        master_bytes=0,
        grad_bytes=2,
        moment_bytes=2,
    ),
    "int8-sync": Config(
        "full AdamW8bit, bf16 masters (the weights), stochastic rounding, sync steps", **INT8
    ),
    "int8-async": Config(
        "full AdamW8bit, bf16 masters (the weights), stochastic rounding, async steps",
        is_async=True,
        **INT8,
    ),
    "int8-backward": Config(
        "AdamW8bit per parameter stepped in backward, bf16 masters (the weights), no clipping",
        in_backward=True,
        **{**INT8, "grad_bytes": 0},
    ),
}

MODEL = {
    "vocab_size": 16384,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}


def shape_model(layers: int, width: int) -> None:
    """Set :data:`MODEL`'s depth and width (heads of 128, half as many KV heads, an MLP
    four times as wide as the model)."""
    heads = max(1, width // 128)
    MODEL.update(
        num_hidden_layers=layers,
        hidden_size=width,
        intermediate_size=4 * width,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
    )


COMPONENTS = ("weights", "spare", "masters", "grads", "moments", "download_cache")


def host_bytes(devices) -> int:
    """RSS minus what the emulated devices hold (RSS read first: see the docstring)."""
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * PAGE
    return rss - sum(device.memory_allocated() for device in devices)


class Sampler:
    """The largest :func:`host_bytes` seen, sampled in a background thread."""

    def __init__(self) -> None:
        self.devices: list = []
        self.peak = host_bytes(self.devices)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> int:
        value = host_bytes(self.devices)
        self.peak = max(self.peak, value)
        return value

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def build_model(config: Config):
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.Qwen3Config(**MODEL)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    if config.lora:
        import peft

        lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear")
        model = peft.get_peft_model(model, lora)
    return model.train()


def expected(model, config: Config) -> dict[str, int]:
    """Bytes of each component, from the parameter count (see the docstring)."""
    params = list(model.parameters())
    trainable = sum(p.numel() for p in params if p.requires_grad)
    model_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return {
        "weights": sum(p.numel() * p.element_size() for p in params),
        "spare": model_bytes if config.is_async else 0,
        "masters": round(trainable * config.master_bytes),
        "grads": round(trainable * config.grad_bytes),
        "moments": round(2 * trainable * config.moment_bytes),
    }


def build_optimizer(pipe, config: Config):
    import torch

    if config.optimizer is None:
        return torch.optim.AdamW(pipe.optim_parameters(), lr=1e-5, fused=True)
    from roundpipe.optim import make_adamw

    return make_adamw(pipe.optim_parameters(), lr=1e-5, **config.optimizer)


def step_in_backward(
    pipe, config: Config, sampler: Sampler, baseline: int
) -> list[tuple[int, int, int]]:
    """One optimizer per master, stepped by its post-accumulate-grad hook, each hook
    sampling the host figure, the bytes of the gradients and of the download blocks
    held first (into the returned list)."""
    from roundpipe.optim import make_adamw

    masters = list(pipe.optim_parameters())
    optimizers = {p: make_adamw([p], lr=1e-5, **config.optimizer) for p in masters}
    samples: list[tuple[int, int, int]] = []

    def hook(param) -> None:
        grads = sum(m.grad.nbytes for m in masters if m.grad is not None)
        blocks = pipe.pool.host_blocks.stats().held_bytes
        samples.append((sampler.sample() - baseline, grads, blocks))
        optimizers[param].step()
        optimizers[param].zero_grad(set_to_none=True)

    for master in masters:
        master.register_post_accumulate_grad_hook(hook)
    return samples


def measure(name: str, steps: int, batch: int, seq: int, devices: int) -> dict:
    """Train configuration ``name`` in this process and return its figures."""
    import torch

    import roundpipe
    from roundpipe.devices import EmulatedDevicePool, EmulatedOptions

    config = CONFIGS[name]
    sampler = Sampler()
    baseline = sampler.sample()
    started = time.perf_counter()
    model = build_model(config)
    run_config = roundpipe.RoundPipeRunConfig(num_microbatch=min(batch, 2))
    options = dict(config.pipe_options)
    if "optim_dtype" in options:
        options["optim_dtype"] = getattr(torch, options["optim_dtype"])
    # Layers' computed tensors (activations, a stage's weight gradients) count as device
    # memory, so a sample taken while a call runs does not count them as host memory.
    pool = EmulatedDevicePool(devices, EmulatedOptions(count_compute_memory=True))
    pipe = roundpipe.from_hf(model, devices=pool, model_run_config=run_config, **options)
    sampler.devices = list(pipe.pool.devices)
    optimizer = build_optimizer(pipe, config)
    steady: list[int] = []
    cache: list[int] = []
    trimmed: list[int] = []

    def step() -> None:
        steady.append(sampler.sample() - baseline)  # every gradient in, nothing freed
        cache.append(pipe.pool.host_blocks.stats().held_bytes)
        if len(steady) == steps:  # the last step: what the C allocator gives back
            LIBC.malloc_trim(0)
            trimmed.append(host_bytes(sampler.devices) - baseline)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    hooked: list[tuple[int, int, int]] = []
    grads_held: list[int] = []
    if config.in_backward:
        hooked = step_in_backward(pipe, config, sampler, baseline)
    generator = torch.Generator().manual_seed(0)
    loss = None
    for _ in range(steps):
        ids = torch.randint(0, MODEL["vocab_size"], (batch, seq), generator=generator)
        loss = pipe.forward_backward(input_kwargs={"input_ids": ids, "labels": ids})
        if not config.in_backward:
            pipe.step(step, is_async=config.is_async)
            continue
        pipe.synchronize()  # the steady figure: the largest any hook of the call saw
        figure, grads, blocks = max(hooked)
        steady.append(figure)
        grads_held.append(grads)
        cache.append(blocks)
        hooked.clear()
        if len(steady) == steps:
            before_trim = host_bytes(sampler.devices) - baseline
            LIBC.malloc_trim(0)
            trimmed.append(host_bytes(sampler.devices) - baseline + steady[-1] - before_trim)
    pipe.synchronize()
    final_loss = float(loss)
    sampler.stop()
    seconds = time.perf_counter() - started
    parts = expected(model, config)
    parts["download_cache"] = cache[-1]
    if config.in_backward:  # the gradients held when the steady figure was taken
        parts["grads"] = grads_held[-1]
    params = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    pipe.close()
    pool.close()
    return {
        "config": name,
        "description": config.description,
        "params": params,
        "trainable_params": trainable,
        "bytes_per_param": steady[-1] / trainable,
        "peak_bytes_per_param": (sampler.peak - baseline) / trainable,
        "bytes_per_model_param": steady[-1] / params,
        "final_loss": final_loss,
        "steady_bytes": steady[-1],
        "steady_bytes_by_step": steady,
        "peak_bytes": sampler.peak - baseline,
        "baseline_bytes": baseline,
        "expected_bytes": parts,
        "other_bytes": steady[-1] - sum(parts.values()),
        "trimmable_bytes": steady[-1] - trimmed[-1],
        "steps": steps,
        "seconds": round(seconds, 1),
    }


def run_in_subprocess(name: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--worker", name, "--steps", str(args.steps)]
    command += ["--batch", str(args.batch), "--seq", str(args.seq), "--devices", str(args.devices)]
    command += ["--layers", str(args.layers), "--width", str(args.width)]
    env = dict(os.environ)
    if args.mmap_threshold is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    row["mmap_threshold"] = args.mmap_threshold
    return row


def print_table(rows: list[dict]) -> None:
    print(
        f"model: Qwen3-shaped, {rows[0]['params'] / 1e6:.1f} M params, bf16, "
        f"{MODEL['num_hidden_layers']} layers of width {MODEL['hidden_size']}; "
        "host bytes per trainable parameter (/model: per parameter of the model)"
    )
    print(f"{'config':<12} {'trainable':>10} {'steady':>7} {'peak':>7} {'/model':>7} {'loss':>7}")
    for row in rows:
        print(
            f"{row['config']:<12} {row['trainable_params'] / 1e6:>9.1f}M "
            f"{row['bytes_per_param']:>7.2f} {row['peak_bytes_per_param']:>7.2f} "
            f"{row['bytes_per_model_param']:>7.2f} {row['final_loss']:>7.3f}"
        )
    print("\nwhere the steady-state bytes go, per parameter of the model:")
    names = (*COMPONENTS, "other", "trimmable", "total")
    print(f"{'config':<12} " + " ".join(f"{name[:9]:>9}" for name in names))
    for row in rows:
        per = row["params"]
        parts = [row["expected_bytes"][c] / per for c in COMPONENTS]
        parts += [row["other_bytes"] / per, row["trimmable_bytes"] / per]
        parts.append(row["bytes_per_model_param"])
        print(f"{row['config']:<12} " + " ".join(f"{v:>9.2f}" for v in parts))
    print("(trimmable: part of other that malloc_trim(0) gives back)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--width", type=int, default=2048, help="hidden size (default 2048)")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="glibc's MALLOC_MMAP_THRESHOLD_ for the runs (e.g. 65536): allocations that "
        "large are mapped and given back when freed (default: glibc's dynamic threshold)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape_model(args.layers, args.width)
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the steady state needs a previous step)")
    if args.worker:
        row = measure(args.worker, args.steps, args.batch, args.seq, args.devices)
        print(json.dumps(row))
        return
    rows = []
    for name in args.config or list(CONFIGS):
        row = run_in_subprocess(name, args)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    if not args.json:
        print_table(rows)


if __name__ == "__main__":
    main()

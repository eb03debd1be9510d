"""Long context: the memory law of a tiled decoder layer, measured, and the longest
sequences it predicts (docs/design.md#long-context).

    .venv/bin/python bench/long_context.py --law      # emulated device, a few minutes
    .venv/bin/python bench/long_context.py --table    # predictions, the paper's models
    python3 bench/long_context.py --gpu cuda:0        # on a GPU (bench/gpu_check.sh)

``--law`` trains one step of a two-layer Llama-shaped bf16 model on one emulated
device that counts what layers compute, one stage per unit and every layer's input
saved, and prints the device's peak less three copies of the weights, per token, at
4K, 8K and 16K tokens, causal and packed (examples of 1000 tokens), at two MLP widths,
tiled (256-token chunks) and untiled, beside what ``roundpipe.predict`` charges.

``--table``: the five models of the paper on a 24 GB RTX 4090, batch 1: the paper's
longest sequence, our untiled prediction (the paper's law) and the tiled one, what
bounds it and the host RAM it needs.

``--gpu``: a Llama-3.1-8B-shaped model cut to ``--layers`` decoder layers trains one
step at the longest sequence predicted for a ``--budget-gib`` GPU (the CUDA caching
allocator capped to it), and the measured peak is printed beside the prediction.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace

import torch

import roundpipe
from roundpipe import EmulatedOptions, RoundPipeRunConfig
from roundpipe.core.tiling import DEFAULT_SEQ_CHUNK_TOKENS
from roundpipe.predict.gpus import gpu_preset
from roundpipe.predict.host_settings import LeanSettings
from roundpipe.predict.model_specs import ModelSpec, model_preset
from roundpipe.predict.models import Workload, max_seq_len, memory_at
from roundpipe.predict.unit_costs import tiled_layer_bytes

PAPER = [  # model, LoRA rank, the paper's longest sequence on 8x RTX 4090
    ("Qwen3-1.7B", 0, 73_000),
    ("Llama-3.1-8B", 0, 49_000),
    ("gpt-oss-20b", 0, 39_000),
    ("Qwen3-32B", 0, 28_000),
    ("Qwen3-235B-A22B", 16, 31_000),
]
LLAMA_8B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=1 << 22,
    attn_implementation="sdpa",
)


TINY = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_attention_heads=4,
            num_key_value_heads=2)  # fmt: skip
"""``--tiny``: a small Llama shape for a dry run of ``--gpu`` on the emulated device."""


def tiny_llama(intermediate: int):
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=intermediate,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 16,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def one_step(model, tokens: int, packed: bool, chunk, devices: str, options=None) -> int:
    """Train one step of ``tokens`` (one stage per unit, layer inputs saved); the peak."""
    ids = torch.randint(0, model.config.vocab_size, (1, tokens))
    batch = {"input_ids": ids, "labels": ids.clone()}
    if packed:
        batch["position_ids"] = (torch.arange(tokens) % 1000).unsqueeze(0)
    units = model.config.num_hidden_layers + 2
    plan = ",".join(["1"] * (units - 1)) + "|" + ",".join(["1"] * units)
    config = RoundPipeRunConfig(
        num_microbatch=1, recompute_grain="layer", execute_plan=plan, seq_chunk_tokens=chunk
    )
    with roundpipe.from_hf(
        model, devices=devices, model_run_config=config, emulated_options=options
    ) as pipe:
        pipe.forward_backward(input_kwargs=batch)
        pipe.synchronize()
        return pipe.device_memory()[0]["peak"]


def law() -> None:
    options = EmulatedOptions(count_compute_memory=True)
    for packed in (False, True):
        for width in (344, 688):
            for chunk in (256, None):
                model = tiny_llama(width)
                spec = ModelSpec.from_config(model.config)
                weights = sum(p.numel() * p.element_size() for p in model.parameters())
                row = {"packed": packed, "intermediate": width, "chunk": chunk}
                for tokens in (4096, 8192, 16384):
                    peak = one_step(model, tokens, packed, chunk, "emulated:1", options)
                    row[f"{tokens // 1024}K"] = round((peak - 3 * weights) / tokens)
                if chunk is not None:
                    row["predicted_16K"] = round(tiled_layer_bytes(spec, 16384, chunk) / 16384)
                print(json.dumps(row), flush=True)


def table() -> None:
    gpu = gpu_preset("rtx4090")
    for name, rank, paper in PAPER:
        spec = model_preset(name)
        for quantize in (None, "nf4") if rank else (None,):
            # the paper's adapters leave the routed experts (peft before 0.22)
            work = Workload(2048, 1, precision="fp16-acc16", lora_rank=rank, lora_experts=False)
            work = replace(work, settings=LeanSettings(quantize=quantize))
            untiled = max_seq_len(spec, gpu, work, seq_chunk_tokens=None)
            tiled = max_seq_len(spec, gpu, work)
            row = {
                "model": name + (f" LoRA {rank}" if rank else "") + (" NF4" if quantize else ""),
                "paper": paper,
                "untiled": untiled.max_seq_len,
                "tiled": tiled.max_seq_len,
                "vs_paper": round(tiled.max_seq_len / paper, 2),
                "bound_by": f"{tiled.bound_by}: {tiled.limit}",
                "host_ram_gib": round(tiled.host_ram / 2**30),
                "saved_inputs_gib": round(tiled.saved_activations / 2**30),
            }
            print(json.dumps(row), flush=True)


def gpu(device: str, layers: int, budget_gib: float, max_tokens: int | None, tiny: bool) -> None:
    """On ``cuda:N`` the caching allocator is capped to the budget; on ``emulated:1``
    (a dry run of the same path, with ``--tiny`` shapes) the device's capacity is."""
    import transformers

    budget, options = int(budget_gib * 2**30), None
    if device.startswith("emulated"):
        options = EmulatedOptions(capacity_bytes=budget, count_compute_memory=True)
    else:
        index = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(index).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), index)
    shape = {**LLAMA_8B, **(TINY if tiny else {})}
    config = transformers.LlamaConfig(**shape, num_hidden_layers=layers)
    spec = ModelSpec.from_config(config)
    target = replace(gpu_preset("h200"), memory_bytes=budget)
    longest = max_seq_len(
        spec, target, Workload(2048, 1), None, 256 if tiny else DEFAULT_SEQ_CHUNK_TOKENS
    )
    tokens = min(longest.max_seq_len, max_tokens or longest.max_seq_len)
    chunk = 256 if tiny else DEFAULT_SEQ_CHUNK_TOKENS
    predicted = memory_at(spec, target, Workload(2048, 1), tokens, chunk).device.total
    print(f"budget {budget_gib} GiB: predicted longest {longest.max_seq_len} tokens "
          f"({longest.limit}); training {tokens} tokens", flush=True)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    start = time.perf_counter()
    chunk = 256 if tiny else DEFAULT_SEQ_CHUNK_TOKENS
    peak = one_step(model, tokens, True, chunk, device, options)
    row = {
        "tokens": tokens,
        "seconds": round(time.perf_counter() - start, 1),
        "measured_peak_gib": round(peak / 2**30, 2),
        "predicted_gib": round(predicted / 2**30, 2),
        "measured_vs_predicted": round(peak / predicted, 3),
    }
    print(json.dumps(row), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--law", action="store_true")
    parser.add_argument("--table", action="store_true")
    parser.add_argument("--gpu", metavar="DEVICE", help="e.g. cuda:0")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--budget-gib", type=float, default=24.0)
    parser.add_argument("--max-tokens", type=int, help="train at most this many tokens")
    parser.add_argument("--tiny", action="store_true", help="--gpu with a small shape")
    args = parser.parse_args()
    if args.law:
        law()
    if args.table:
        table()
    if args.gpu:
        gpu(args.gpu, args.layers, args.budget_gib, args.max_tokens, args.tiny)


if __name__ == "__main__":
    main()

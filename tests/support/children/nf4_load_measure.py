"""Child: load a checkpoint with ``from_pretrained(..., quantize="nf4")`` and report host memory.

Usage: python nf4_load_measure.py DIR (a checkpoint from ``hf_load_generate.py``).
Prints one JSON line (bytes): ``baseline_rss`` (after the imports), ``loaded_peak_rss``
(peak RSS once loaded, from ``getrusage``: it counts file pages of the mapped
embeddings and head too), ``quantized_bytes`` (every host tensor of the loaded model:
NF4 bytes and scales, adapters, and the embeddings, norms and head in bf16),
``nf4_bytes`` and ``nf4_params`` (the decoder linears), ``load_s``, and the ``loss``
of one ``forward_backward`` on two emulated devices, one layer a stage.
"""

from __future__ import annotations

import json
import sys
import time

import peft
import torch
from rss import current_rss, peak_rss

import roundpipe
from roundpipe import Plan, RoundPipeRunConfig
from roundpipe.hf.nf4 import NF4Linear


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def main() -> None:
    directory = sys.argv[1]
    baseline = current_rss()
    start = time.perf_counter()
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    pipe = roundpipe.from_pretrained(
        directory, torch_dtype=torch.bfloat16, lora=lora, quantize="nf4", devices="emulated:2"
    )
    load_s = time.perf_counter() - start
    loaded = peak_rss()
    model = pipe.hf_model
    layers = [m for m in model.modules() if isinstance(m, NF4Linear)]
    layer_count = pipe.num_layers
    plan = Plan(forward=(1,) * (layer_count - 1), backward=(1,) * layer_count)
    config = RoundPipeRunConfig(execute_plan=plan, num_microbatch=2)
    ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = pipe.forward_backward(input_kwargs={"input_ids": ids, "labels": ids}, run_config=config)
    pipe.synchronize()
    result = {
        "baseline_rss": baseline,
        "loaded_peak_rss": loaded,
        "quantized_bytes": nbytes([*model.parameters(), *model.buffers()]),
        "nf4_bytes": nbytes(p for m in layers for p in m.parameters()),
        "nf4_params": sum(m.in_features * m.out_features for m in layers),
        "load_s": load_s,
        "loss": float(loss),
    }
    pipe.close()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

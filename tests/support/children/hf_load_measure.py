"""Child: load a checkpoint with ``roundpipe.from_pretrained`` and report host memory.

Usage: python hf_load_measure.py full|lora DIR. Prints one JSON line (bytes):

- ``full``: ``baseline_rss`` (after the imports), ``loaded_peak_rss`` (peak RSS after
  ``from_pretrained``, from ``getrusage``), ``masters_bytes`` and
  ``masters_peak_rss`` (after ``optim_parameters()`` made the fp32 masters).
- ``lora``: loads with a LoRA config, runs one ``forward_backward`` + ``step`` +
  ``synchronize`` on two emulated devices with one layer per stage, and reports
  ``baseline_anon`` and ``peak_anon`` (``RssAnon`` of /proc/self/status, polled by a
  thread every millisecond: file-backed pages of the mapped checkpoint are not
  anonymous memory), ``mapped_bytes`` (base weights that are views of the files),
  ``largest_layer_bytes`` and ``loss``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

import peft
import torch
from rss import current_rss, peak_rss

import roundpipe
from roundpipe import Plan, RoundPipeRunConfig
from roundpipe.hf.safetensors_io import is_mapped


def anon_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


class AnonPeak:
    """The highest RssAnon seen by a sampling thread while the context runs."""

    def __init__(self, interval_s: float = 0.001) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, anon_bytes())
            time.sleep(self.interval_s)

    def __enter__(self) -> AnonPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, anon_bytes())


def measure_full(directory: str) -> dict:
    baseline = current_rss()
    pipe = roundpipe.from_pretrained(directory, torch_dtype=torch.bfloat16, devices="emulated:2")
    loaded = peak_rss()
    masters = list(pipe.optim_parameters())
    result = {
        "baseline_rss": baseline,
        "loaded_peak_rss": loaded,
        "masters_bytes": sum(m.numel() * m.element_size() for m in masters),
        "masters_peak_rss": peak_rss(),
    }
    pipe.close()
    return result


def measure_lora(directory: str) -> dict:
    baseline = anon_bytes()
    with AnonPeak() as anon:
        lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
        pipe = roundpipe.from_pretrained(
            directory, torch_dtype=torch.bfloat16, lora=lora, devices="emulated:2"
        )
        layers = pipe.num_layers
        plan = Plan(forward=(1,) * (layers - 1), backward=(1,) * layers)  # one layer a stage
        config = RoundPipeRunConfig(execute_plan=plan, num_microbatch=2)
        optimizer = torch.optim.AdamW(pipe.optim_parameters(), lr=1e-3)
        ids = torch.randint(0, 8192, (2, 16), generator=torch.Generator().manual_seed(0))
        loss = pipe.forward_backward(
            input_kwargs={"input_ids": ids, "labels": ids}, run_config=config
        )
        pipe.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        pipe.synchronize()
        base = [p for p in pipe.hf_model.parameters() if not p.requires_grad]
        mapped = sum(p.numel() * p.element_size() for p in base if is_mapped(p))
        largest = max(
            sum(p.numel() * p.element_size() for p in layer.parameters())
            for layer in pipe.model.children()
        )
        pipe.close()
    return {
        "baseline_anon": baseline,
        "peak_anon": anon.peak,
        "mapped_bytes": mapped,
        "largest_layer_bytes": largest,
        "loss": float(loss),
    }


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    result = measure_full(directory) if mode == "full" else measure_lora(directory)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

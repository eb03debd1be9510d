"""Which Hugging Face architectures roundpipe trains, and what the general path costs.

Every architecture of ``tests/support/architectures.py`` (tiny random models from
transformers' own config classes, their quirks on) through ``from_hf`` on two emulated
devices, 3 microbatches of a 5-row batch, against the transformers model alone on the
CPU: is the loss the model's (exact?), which path ran it (our own adapter, the general
path), and seconds per step of each (median of ``--repeats``; a tiny model on the
emulator measures Python overhead, not GPU speed).

    .venv/bin/python bench/model_breadth.py                 # the table
    .venv/bin/python bench/model_breadth.py --readme        # the README's table
    .venv/bin/python bench/model_breadth.py --overhead      # general path vs adapter

``--overhead``: the same Llama weights through our own adapter and through the general
path (a model type the adapter does not know), alternating, same microbatches;
per-step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the catalogue

import roundpipe  # noqa: E402
from roundpipe import RoundPipeRunConfig  # noqa: E402


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import transformers

    transformers.logging.set_verbosity_error()


def _median_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def breadth(repeats: int) -> None:
    from support.architecture_status import REFUSED
    from support.architectures import ARCHITECTURES, padded_batch

    batch = padded_batch(side="right")
    print(f"{'architecture':18} {'path':9} {'exact?':>8} {'s/step rp':>10} {'s/step hf':>10}")
    for arch in ARCHITECTURES:
        if arch.name in REFUSED:
            print(f"{arch.name:18} refused: {REFUSED[arch.name]}")
            continue
        model = arch.build()
        reference = copy.deepcopy(model)

        def hf_step(reference=reference) -> torch.Tensor:
            loss = reference(**batch, use_cache=False).loss
            loss.backward()
            return loss

        want = float(hf_step())
        config = RoundPipeRunConfig(num_microbatch=3)
        with roundpipe.from_hf(model, devices="emulated:2", model_run_config=config) as pipe:
            path = "adapter" if type(pipe.model[0]).__name__ == "EmbedLayer" else "general"
            got = float(pipe.forward_backward(input_kwargs=batch))

            def rp_step(pipe=pipe) -> None:
                pipe.forward_backward(input_kwargs=batch)
                pipe.synchronize()

            rp = _median_seconds(rp_step, repeats)
        hf = _median_seconds(hf_step, repeats)
        exact = abs(got - want) / abs(want)
        print(f"{arch.name:18} {path:9} {exact:8.1e} {rp:10.4f} {hf:10.4f}", flush=True)


def overhead(repeats: int, layers: int) -> None:
    import transformers

    class GeneralConfig(transformers.LlamaConfig):
        model_type = "roundpipe_bench_llama"

    sizes = dict(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    adapter_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    general_model = transformers.LlamaForCausalLM(GeneralConfig(**sizes))
    general_model.load_state_dict(adapter_model.state_dict())
    ids = torch.randint(0, 128, (8, 128), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    config = RoundPipeRunConfig(num_microbatch=4)
    pipes = {
        name: roundpipe.from_hf(model, devices="emulated:2", model_run_config=config)
        for name, model in (("adapter", adapter_model), ("general", general_model))
    }
    losses = {
        name: float(pipe.forward_backward(input_kwargs=batch)) for name, pipe in pipes.items()
    }
    times: dict[str, list[float]] = {name: [] for name in pipes}
    for _ in range(repeats):  # alternating, so load on the machine hits both alike
        for name, pipe in pipes.items():
            start = time.perf_counter()
            pipe.forward_backward(input_kwargs=batch)
            pipe.synchronize()
            times[name].append(time.perf_counter() - start)
    for pipe in pipes.values():
        pipe.close()
    adapter, general = (statistics.median(times[n]) for n in ("adapter", "general"))
    print(f"Llama, {layers} layers, 8 x 128 tokens, 4 microbatches, emulated:2, {repeats} steps")
    print(f"losses: adapter {losses['adapter']:.6f}, general {losses['general']:.6f}")
    print(
        f"s/step: adapter {adapter:.4f}, general {general:.4f}, "
        f"general/adapter {general / adapter:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", action="store_true", help="print the README's table")
    parser.add_argument("--overhead", action="store_true", help="general path vs adapter")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=8, help="Llama layers for --overhead")
    args = parser.parse_args()
    _quiet()
    if args.readme:
        from support.architecture_status import readme_table

        print(readme_table())
    elif args.overhead:
        overhead(args.repeats, args.layers)
    else:
        breadth(args.repeats)


if __name__ == "__main__":
    main()

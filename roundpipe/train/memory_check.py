"""Host memory in ``roundpipe train``: the check before the model is loaded, and the
one line a run that runs out of it anyway ends with (docs/design.md#the-memory-check).

:func:`check_host_memory` prices the run's host RAM with ``roundpipe simulate``'s own
accounting (:func:`roundpipe.predict.models.memory_fit`: the weights, their spare
version, masters, gradients, optimizer state, saved activations and page-locked
buffers) and judges it against the usable share of what this process may still
allocate (:func:`roundpipe.predict.host_memory.usable_ram`). That room leaves out what
the process already holds (Python, torch, transformers: the fixed overhead is counted
by being used), and the usable share (``MEMORY_HEADROOM``, as ``simulate`` judges a
host) keeps a margin for what the run adds outside the terms (the data, threads, a
CUDA context). A run that does not fit is refused with what it needs, term by term,
what the machine has and the nearest settings that fit, found by ``simulate``'s
:func:`~roundpipe.predict.lean_fit.lean_fit` and
:func:`~roundpipe.predict.nearest.nearest_fit`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..core.config import RoundPipeRunConfig
from ..devices import device_count
from ..errors import error_chain
from ..predict.breakdown import MemoryFit
from ..predict.gpus import GIB, GPU_PRESETS, PRECISIONS
from ..predict.host_memory import usable_ram
from ..predict.host_settings import LeanSettings
from ..predict.lean_fit import lean_fit
from ..predict.model_specs import ModelSpec
from ..predict.models import Workload, memory_fit
from ..predict.nearest import nearest_fit
from ..predict.peft_targets import targets_reach_experts
from .optim import optimizer_settings
from .options import TrainOptions
from .usage import UsageError

PRICED_GPU = replace(GPU_PRESETS["h100"], name="any GPU", memory_bytes=2**60)
"""The GPUs the host's terms are priced with: only the host RAM is judged here (what a
GPU holds is the runtime's to plan and report), so their memory is unbounded and their
rates (which the terms do not depend on) an H100's."""
_CPU_ALLOCATOR = re.compile(r"DefaultCPUAllocator: (can't allocate memory|not enough memory)")
_TRIED = re.compile(r"tried to allocate (\d+) bytes")


class OutOfHostMemory(RuntimeError):
    """The host ran out of memory during the run: the message is the line to show."""


def check_host_memory(options: TrainOptions, config: Any, world: int) -> None:
    """Refuse a run of ``options`` on the model of ``config`` (its Hugging Face config),
    one of ``world`` processes, that cannot fit the host RAM this process may still
    allocate. A model the accounting cannot price, or a machine that tells no room, is
    not judged."""
    room = usable_ram()
    if room is None:
        return
    try:
        spec = ModelSpec.from_config(config)
    except ValueError:  # a layer kind or feature the predictor does not price
        return
    assert options.devices is not None
    devices = device_count(options.devices)
    work = run_workload(options, world, devices)
    memory = memory_fit(spec, PRICED_GPU, work, devices, room.bytes)
    budget = memory.host_budget
    if budget is None or memory.host_fits:
        return
    fixes = _fixes(options, spec, work, devices, room.bytes, memory)
    raise UsageError(
        f"host memory: this run needs {_gib(memory.host.total)} GiB of host RAM "
        f"({_terms(memory)}), more than the {_gib(budget.available)} GiB usable here "
        f"({budget.usable_fraction:.0%} of the {_gib(room.bytes)} GiB this process may "
        f"still allocate: {room.bound}); {fixes}; or give --no-memory-check to start anyway"
    )


def run_workload(options: TrainOptions, world: int, devices: int) -> Workload:
    """What one process of the run on ``devices`` devices holds, as ``simulate`` prices
    it: its share of the batch in ``--microbatches`` (default devices + 1), all of them
    one call per step, the masters and optimizer state split over ``world`` processes."""
    assert options.seq_len is not None and options.precision is not None
    rows = max(options.batch_size // world, 1)
    run_config = RoundPipeRunConfig(num_microbatch=options.microbatches)
    count = run_config.microbatches_for(devices, rows)
    per_example = 2 if options.method == "dpo" else 1  # a pair's rows in one microbatch
    states, masters = optimizer_settings(options)
    quantize = None if options.quantize == "none" else options.quantize
    fp32 = options.precision not in PRECISIONS
    return Workload(
        seq_len=options.seq_len,
        batch=per_example * rows,
        microbatch_size=per_example * -(-rows // count),
        # an fp32 run's kernels have no preset rate: its time is not asked, only bytes
        precision="fp16" if fp32 else options.precision,
        lora_rank=0 if options.full else options.lora_r,
        lora_experts=targets_reach_experts(options.lora_target_modules()),
        round_size=rows,
        optimizer_shards=world,
        settings=LeanSettings(states, masters, quantize),
        step="sync" if options.sync else "async",
        weight_bytes=4 if fp32 else 2,
        greedy_plan=True,
    )


def _fixes(
    options: TrainOptions,
    spec: ModelSpec,
    work: Workload,
    devices: int,
    room: int,
    memory: MemoryFit,
) -> str:
    """The nearest settings that fit, in ``roundpipe train``'s options; else the least
    any of them needs."""
    found = []
    lean = lean_fit(spec, PRICED_GPU, work, devices, room, memory, adapter_optimizer=False)
    if lean is not None and lean.fits:
        found.append(f"{lean.settings.flags} ({_gib(lean.host_ram)} GiB)")
    near = nearest_fit(spec, PRICED_GPU, work, devices, room, memory)
    if near is not None and near.memory is not None:
        option = f"{near.option} {near.value}"
        if near.option == "--lora":
            option = f"--lora-r {near.value}" + (" (LoRA: without --full)" if options.full else "")
        if near.option == "--no-lora-experts":  # peft 0.22's all-linear adapts every expert
            option = (
                "--lora-targets naming no expert projection (all-linear adapts each routed "
                "expert: e.g. q_proj,k_proj,v_proj,o_proj)"
            )
        found.append(f"{option} ({_gib(near.memory.host.total)} GiB)")
    if not found and lean is not None and lean.changed:
        return (
            f"no nearby setting fits (even {lean.settings.flags} needs {_gib(lean.host_ram)} GiB)"
        )
    if not found:
        return "no nearby setting fits"
    return "fits with " + ", or with ".join(found)


def _terms(memory: MemoryFit) -> str:
    terms = memory.host.terms()
    return ", ".join(
        f"{name.replace('_', ' ')} {_gib(size)}" for name, size in terms.items() if size
    )


@contextmanager
def reporting_host_memory(newest: Callable[[], tuple[int, Path] | None]) -> Iterator[None]:
    """Raise :class:`OutOfHostMemory` if what runs inside runs out of host memory (a
    ``MemoryError`` or torch's CPU allocator failing), naming the newest checkpoint
    written (``newest()``: its step and path, ``None`` if there is none)."""
    try:
        yield
    except Exception as error:
        cause = host_memory_exhausted(error)
        if cause is None:
            raise
        tried = _TRIED.search(str(cause))
        size = f" (allocating {_gib(int(tried.group(1)))} GiB)" if tried else ""
        checkpoint = newest()
        if checkpoint is None:
            then = "no checkpoint was written; free memory or use leaner settings, then run again"
        else:
            step, path = checkpoint
            then = (
                f"the newest checkpoint is {path} (step {step}); free memory or use "
                "leaner settings, then continue with --resume"
            )
        raise OutOfHostMemory(f"out of host memory{size}: {then}") from error


def host_memory_exhausted(error: BaseException) -> BaseException | None:
    """The error in ``error``'s chain that says the host ran out of memory, if any."""
    for each in error_chain(error):
        if isinstance(each, MemoryError) or _CPU_ALLOCATOR.search(str(each)):
            return each
    return None


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f}"

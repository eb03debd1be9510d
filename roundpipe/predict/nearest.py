"""The nearest configuration that fits, when RoundPipe's does not.

One setting moves at a time, from the user's configuration, in this order (the first
that fits GPU memory and host RAM is the answer; docs/design.md#nearest-fit):

1. LoRA: no adapters on the routed experts where peft adds them (``--no-lora-experts``),
   then a lower rank (halved, down to 1). Full fine-tuning: LoRA, the highest rank of
   ``LORA_RANKS`` that fits.
2. More microbatches per iteration (smaller ones, less activation memory each): the
   fewest that split the batch evenly.
3. A shorter sequence: the longest that fits, to ``SEQ_LEN_STEP`` tokens.

When host RAM does not fit, the answer also gives the RAM the run needs as it is.
Each candidate is judged by :func:`.models.memory_fit`, the accounting the prediction
itself uses, with its own automatic plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial

from .breakdown import MemoryFit
from .gpus import GIB, Gpu
from .model_costs import adapted_spec
from .model_specs import ModelSpec
from .models import Workload, memory_fit

LORA_RANKS = (64, 32, 16, 8, 4, 2, 1)
SEQ_LEN_STEP = 256


@dataclass(frozen=True)
class Suggestion:
    """What to change so that the run fits, and its memory once changed."""

    option: str | None
    """The command-line option to change (``--no-lora-experts``, ``--lora``,
    ``--microbatches``, ``--seq-len``); ``None`` when no nearby configuration fits."""
    value: int | None
    """The option's value (``None`` for a flag)."""
    memory: MemoryFit | None
    host_ram_needed: int | None = None
    """When the host RAM does not fit: the RAM (bytes) the run fits in as it is."""
    gpu_short: bool = False
    """Whether the run as it is does not fit the GPUs."""

    @property
    def text(self) -> str:
        parts = []
        if self.host_ram_needed is not None:
            parts.append(
                f"as it is, the run needs {_gib(self.host_ram_needed)} GiB of host RAM "
                "(give --host-ram for the target server)"
            )
        if self.memory is not None:
            fit = self.memory
            host = "" if fit.host_budget is None else f", host RAM {_gib(fit.host.total)} GiB"
            option = self.option if self.value is None else f"{self.option} {self.value}"
            parts.append(f"{option} fits (GPU {_gib(fit.device.total)} GiB{host})")
        else:
            gpu = ": a GPU with more memory is needed" if self.gpu_short else ""
            parts.append(
                "no lower LoRA rank, more microbatches or sequence of at least "
                f"{SEQ_LEN_STEP} tokens fits{gpu}"
            )
        return ", or ".join(parts)

    def to_dict(self) -> dict:
        memory = self.memory
        return {
            "option": self.option,
            "value": self.value,
            "host_ram_needed": self.host_ram_needed,
            "gpu_memory": None if memory is None else memory.device.total,
            "host_ram": None if memory is None else memory.host.total,
            "text": self.text,
        }


def nearest_fit(
    spec: ModelSpec,
    gpu: Gpu,
    work: Workload,
    num_gpus: int,
    host_ram: int | None,
    memory: MemoryFit,
) -> Suggestion | None:
    """The first configuration in the module's order that fits; ``None`` if ``memory``
    (the user's configuration's) already fits."""
    if memory.fits_all:
        return None
    needed = None
    if memory.host_fits is False and memory.host_budget is not None:
        needed = math.ceil(memory.host.total / memory.host_budget.usable_fraction)
    found = partial(Suggestion, host_ram_needed=needed, gpu_short=not memory.fits)

    def fit(candidate: Workload) -> MemoryFit | None:
        result = memory_fit(spec, gpu, candidate, num_gpus, host_ram)
        return result if result.fits_all else None

    for option, value, candidate in _one_setting_moved(spec, work):
        fitting = fit(candidate)
        if fitting is not None:
            return found(option, value, fitting)
    shorter = _longest_seq_len(work, fit)
    if shorter is not None:
        return found("--seq-len", *shorter)
    return found(None, None, None)


def _one_setting_moved(
    spec: ModelSpec, work: Workload
) -> Iterator[tuple[str, int | None, Workload]]:
    """Steps 1 and 2 of the module's order, nearest first."""
    if work.lora_rank and adapted_spec(spec, work).expert_adapters:
        yield "--no-lora-experts", None, replace(work, lora_experts=False)
    if work.lora_rank:
        rank = work.lora_rank // 2
        while rank >= 1:
            yield "--lora", rank, replace(work, lora_rank=rank)
            rank //= 2
    else:
        for rank in LORA_RANKS:
            yield "--lora", rank, replace(work, lora_rank=rank)
    for count in range(work.num_microbatches + 1, work.batch + 1):
        if work.batch % count == 0:
            yield "--microbatches", count, replace(work, microbatch_size=work.batch // count)


def _longest_seq_len(
    work: Workload, fit: Callable[[Workload], MemoryFit | None]
) -> tuple[int, MemoryFit] | None:
    """Step 3: halve the sequence until it fits, then bisect back up, in steps of
    ``SEQ_LEN_STEP`` (memory grows with the sequence)."""
    step = SEQ_LEN_STEP
    high = -(-work.seq_len // step)  # in steps; ``high * step`` does not fit
    low, found = high // 2, None
    while low >= 1:
        found = fit(replace(work, seq_len=low * step))
        if found is not None:
            break
        high, low = low, low // 2
    if found is None:
        return None
    while high - low > 1:
        middle = (low + high) // 2
        candidate = fit(replace(work, seq_len=middle * step))
        if candidate is not None:
            low, found = middle, candidate
        else:
            high = middle
    return low * step, found


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f}"

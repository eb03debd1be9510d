"""Long sequences in ``roundpipe train``: the tiled layers when a microbatch needs them.

A microbatch of ``rows x --seq-len`` tokens near what the untiled layers can train on the
smallest GPU (over ``AUTO_PLAN_SHARE`` of it) gets one unit per stage and every
layer's input saved (``recompute_grain="layer"``); beyond it, its MLPs and norms are
tiled too, in the largest of ``CHUNKS`` that fits the device
(docs/design.md#long-context); one that even the smallest cannot train is refused
before the first step, with the longest sequence predicted to fit.
The predictions are :func:`roundpipe.predict.models.max_seq_len`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import cast

from ..core.tiling import DEFAULT_SEQ_CHUNK_TOKENS
from ..predict.breakdown import finest_plan
from ..predict.gpus import gpu_preset
from ..predict.host_settings import LeanSettings
from ..predict.model_specs import ModelSpec
from ..predict.models import Workload, max_seq_len
from .optim import optimizer_settings
from .options import TrainOptions
from .ranks import Ranks
from .usage import UsageError

_PRECISION_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
AUTO_PLAN_SHARE = 0.5
"""Up to this share of the untiled layers' longest sequence the automatic plan is kept;
above it the plan the prediction is of is pinned: the automatic planner does not see
the tensors autograd saves inside a layer (docs/design.md#known-gaps)."""
CHUNKS = tuple(DEFAULT_SEQ_CHUNK_TOKENS >> k for k in range(5))
"""The chunks tried, largest first: ``DEFAULT_SEQ_CHUNK_TOKENS`` down to a sixteenth."""


@dataclass(frozen=True)
class SequenceSetting:
    """How a run's layers meet its sequences."""

    seq_chunk_tokens: int | None = None
    finest: bool = False
    """One unit per stage (the plan the predictions are of) and every layer's input
    saved, instead of the automatic plan and the stage grain."""

    @property
    def recompute_grain(self) -> str:
        return "layer" if self.finest else "stage"


def sequence_setting(
    model_config,
    seq_len: int,
    rows: int,
    capacities: list[int | None],
    precision: str | None,
    lora_rank: int = 0,
    settings: LeanSettings | None = None,
) -> SequenceSetting:
    """The setting for microbatches of ``rows`` sequences of ``seq_len`` tokens on
    devices of ``capacities`` bytes (``None``: unbounded, nothing to decide)."""
    if not capacities or None in capacities:
        return SequenceSetting()
    try:
        spec = ModelSpec.from_config(model_config)
    except ValueError:  # a config the predictor cannot read: leave the layers as they are
        return SequenceSetting()
    if not spec.tiled_layers:
        return SequenceSetting()  # the general path runs the model's own layers, untiled
    # the predictions are for 16-bit weights and activations: fp32 needs twice the bytes
    tokens = rows * seq_len * _PRECISION_BYTES.get(precision or "bf16", 2) // 2
    smallest = min(cast(list[int], capacities))  # none is None
    gpu = replace(gpu_preset("rtx4090"), name="the smallest device", memory_bytes=smallest)
    work = Workload(seq_len, 1, lora_rank=lora_rank, settings=settings or LeanSettings())
    untiled = max_seq_len(spec, gpu, work, seq_chunk_tokens=None)
    if tokens <= AUTO_PLAN_SHARE * untiled.max_seq_len:
        return SequenceSetting()
    if tokens <= untiled.max_seq_len:
        return SequenceSetting(None, finest=True)
    for chunk in CHUNKS:  # the largest chunk that fits: the fewest recomputed pieces
        tiled = max_seq_len(spec, gpu, work, seq_chunk_tokens=chunk)
        if tokens <= tiled.max_seq_len:
            return SequenceSetting(chunk, finest=True)
    rows_text = f"{rows} sequences of {seq_len} tokens" if rows > 1 else f"{seq_len} tokens"
    raise UsageError(
        f"a microbatch of {rows_text} does not fit the smallest device "
        f"({smallest / 2**30:.1f} GiB): with tiled layers and every layer's input "
        f"saved, the longest sequence predicted to train on it is {tiled.max_seq_len} "
        f"tokens per microbatch ({tiled.limit} runs out of memory first); lower --seq-len"
        + (", use more microbatches (--microbatches)" if rows > 1 else "")
        + " or train on devices with more memory (roundpipe simulate --max-seq-len "
        "predicts it for a GPU)"
    )


def fit_sequences(pipe, options: TrainOptions, ranks: Ranks) -> None:
    """Set ``pipe``'s run config for the run's sequences, or close it and refuse them."""
    try:
        setting = _setting(pipe, options, ranks)
    except BaseException:
        pipe.close()
        raise
    if setting.finest:
        pipe.run_config = pipe.run_config.replace(
            seq_chunk_tokens=setting.seq_chunk_tokens,
            recompute_grain=setting.recompute_grain,
            execute_plan=finest_plan(pipe.num_layers),
        )


def _setting(pipe, options: TrainOptions, ranks: Ranks) -> SequenceSetting:
    rows = max(1, options.batch_size // ranks.world)
    split = pipe.run_config.microbatches_for(len(pipe.pool), rows)
    states, masters = optimizer_settings(options)
    quantize = None if options.full or options.quantize == "none" else options.quantize
    return sequence_setting(
        pipe.hf_model.config,
        # None in options preflight did not fill; read only for devices of bounded memory
        options.seq_len,  # type: ignore[arg-type]
        -(-rows // split),
        [device.memory_capacity() for device in pipe.pool],
        options.precision,
        0 if options.full else options.lora_r,
        LeanSettings(states, masters, quantize),
    )


def tiling_note(pipe) -> str:
    """For the line that starts training: the long-sequence setting, when on."""
    config = pipe.run_config
    if config.recompute_grain != "layer" or config.execute_plan is None:
        return ""
    tiles = (
        ""
        if config.seq_chunk_tokens is None
        else f" tiled in {config.seq_chunk_tokens}-token chunks"
    )
    return f", one layer per stage{tiles}, every layer's input saved"

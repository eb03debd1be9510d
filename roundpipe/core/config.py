"""Run-time options of a RoundPipe model (how a call is split, planned and recomputed)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from .plan import Plan

SplitInput = Callable[[tuple, dict, int], list[tuple[tuple, dict]]]
SplitLabel = Callable[[Any, int], list[Any]]
MergeOutput = Callable[[list[Any]], Any]

RECOMPUTE_GRAINS = ("stage", "layer")
MAX_PREFETCH_STAGES = 4
"""The most ``prefetch_stages`` allowed (a device worker remembers that many jobs back)."""


@dataclass(frozen=True)
class RoundPipeRunConfig:
    """Options for running the pipeline; pass one to ``RoundPipe`` or to a single call.

    - ``num_microbatch``: microbatches per call; ``None`` means devices + 1
      (:meth:`microbatches_for`).
    - ``execute_plan``: a :class:`~roundpipe.core.plan.Plan` (or its string form
      ``"3,3|1,1,1,1,1,1"``) to pin; ``None`` uses the automatic plan.
    - ``recompute_grain``: ``"stage"`` saves each backward stage's input and
      recomputes the stage; ``"layer"`` saves every layer's input.
    - ``preserve_rng_state``: recompute draws the same random numbers as the forward
      (dropout masks match).
    - ``split_input`` / ``split_label`` / ``merge_output``: replace the default
      splitting along dim 0 (``torch.tensor_split``) and merging (``torch.cat``).
    - ``weight_chunk_bytes``: weight uploads are cut into chunks of at most this size
      so activation uploads can pass them; ``None`` uploads a stage in one piece.
    - ``prefetch_stages``: how many stages ahead a device uploads weights (1: a device
      holds at most two stages' weights). The host allocates a stage's weights only
      once the job ``prefetch_stages`` + 1 back on that device has finished.
    - ``gate_weight_chunks``: a weight chunk enters the device's copy queue only behind
      the activation uploads pending when it is issued (copy engines are FIFO, so this
      is what keeps activations ahead of prefetch); ``False`` issues chunks at once.
    - ``seq_chunk_tokens``: layers that can (the MLPs of ``from_hf`` models) process a
      sequence in chunks of at most this many tokens, each chunk recomputed in the
      backward, so a long sequence's MLP activations never exist at once
      (docs/design.md#long-context); ``None`` runs every layer over the whole sequence.
    - ``scale_grads``: as ``torch.distributed.pipelining``'s, ``forward_backward``
      returns and backpropagates the mean of the ``loss_fn`` values of the
      microbatches, each weighted by its share of the batch's rows, so a ``loss_fn``
      returning a microbatch's mean gives the whole batch's mean, on any device or
      microbatch count; ``False`` keeps their sum. ``from_hf`` models' loss is
      already the mean over the batch's label tokens: they ignore it.
    - ``row_losses``: layers that compute a loss (the head of ``from_hf`` models) give
      one value per row of the microbatch, not their sum (:mod:`.row_losses`; the
      sequence-level losses of :mod:`roundpipe.preference` use it).
    """

    num_microbatch: int | None = None
    execute_plan: Plan | str | None = None
    recompute_grain: str = "stage"
    preserve_rng_state: bool = True
    split_input: SplitInput | None = None
    split_label: SplitLabel | None = None
    merge_output: MergeOutput | None = None
    weight_chunk_bytes: int | None = 256 * 2**20
    prefetch_stages: int = 1
    gate_weight_chunks: bool = True
    seq_chunk_tokens: int | None = None
    scale_grads: bool = True
    row_losses: bool = False

    def __post_init__(self) -> None:
        if self.num_microbatch is not None and (
            not isinstance(self.num_microbatch, int)
            or isinstance(self.num_microbatch, bool)
            or self.num_microbatch < 1
        ):
            raise ValueError(
                f"num_microbatch must be a positive integer or None, got {self.num_microbatch!r}"
            )
        if not isinstance(self.recompute_grain, str):
            raise TypeError(
                f"recompute_grain must be one of {RECOMPUTE_GRAINS}, got {self.recompute_grain!r}"
            )
        if self.recompute_grain not in RECOMPUTE_GRAINS:
            raise ValueError(
                f"recompute_grain must be one of {RECOMPUTE_GRAINS}, got {self.recompute_grain!r}"
            )
        if isinstance(self.execute_plan, str):
            object.__setattr__(self, "execute_plan", Plan.parse(self.execute_plan))
        elif self.execute_plan is not None and not isinstance(self.execute_plan, Plan):
            raise TypeError(
                "execute_plan must be a Plan, a string like '3,3|2,1,1,1,1,1,1' or None, "
                f"got {type(self.execute_plan).__name__}"
            )
        for name in ("preserve_rng_state", "gate_weight_chunks", "scale_grads", "row_losses"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("split_input", "split_label", "merge_output"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be a function or None, got {type(value).__name__}")
        _check_count("weight_chunk_bytes", self.weight_chunk_bytes, optional=True)
        _check_count("prefetch_stages", self.prefetch_stages)
        if not 1 <= self.prefetch_stages <= MAX_PREFETCH_STAGES:
            raise ValueError(
                f"prefetch_stages must be 1 to {MAX_PREFETCH_STAGES}, got {self.prefetch_stages}"
            )
        _check_count("seq_chunk_tokens", self.seq_chunk_tokens, optional=True)
        if self.seq_chunk_tokens is not None and self.seq_chunk_tokens < 1:
            raise ValueError(f"seq_chunk_tokens must be positive, got {self.seq_chunk_tokens}")
        if self.weight_chunk_bytes is not None and self.weight_chunk_bytes < 1:
            raise ValueError(f"weight_chunk_bytes must be positive, got {self.weight_chunk_bytes}")

    def replace(self, **changes: Any) -> RoundPipeRunConfig:
        return replace(self, **changes)

    def microbatches_for(self, devices: int, rows: int | None = None) -> int:
        """How many microbatches a call on ``devices`` devices splits into:
        ``num_microbatch``, else devices + 1 (docs/design.md#stateless-devices); at
        most ``rows`` where a caller gives its batch's rows, so no microbatch is empty."""
        count = self.num_microbatch or devices + 1
        return count if rows is None else min(count, rows)


def _check_count(name: str, value: object, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        what = "an integer or None" if optional else "an integer"
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")


def checked_run_config(value: object, argument: str) -> RoundPipeRunConfig | None:
    """``value`` if it is a :class:`RoundPipeRunConfig` or None, else a TypeError naming
    ``argument`` (e.g. a dict of options, which would fail later with an AttributeError)."""
    if value is None or isinstance(value, RoundPipeRunConfig):
        return value
    hint = f"; write {argument}=RoundPipeRunConfig(**{value!r})" if isinstance(value, dict) else ""
    raise TypeError(
        f"{argument} must be a RoundPipeRunConfig or None, got {type(value).__name__}{hint}"
    )

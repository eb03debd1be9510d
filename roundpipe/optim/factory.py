"""``make_adamw``: AdamW with the masters' and the moments' dtypes the user chose, each
combination served by the library class that does it (docs/design.md#host-memory)."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TypedDict

import torch

from ..errors import install_hint

STATES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": None}
"""The dtypes AdamW's two moments may be kept in (``int8``: torchao's block-wise
8-bit format, a uint8 code and one fp32 scale per 256 values)."""

MASTERS = {torch.float32: "fp32", torch.bfloat16: "bf16"}


class _Options(TypedDict):
    lr: float
    betas: tuple[float, float]
    eps: float
    weight_decay: float


def make_adamw(
    params: Iterable,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    states: str = "fp32",
    stochastic_round: bool = False,
    seed: int | None = None,
) -> torch.optim.Optimizer:
    """AdamW over ``params`` (tensors or param-group dicts) keeping its moments as
    ``states`` ("fp32", "bf16" or "int8"), the masters being the parameters (all fp32
    or all bf16).

    =======  ======  =====================================================
    masters  states  optimizer
    =======  ======  =====================================================
    fp32     fp32    ``torch.optim.AdamW(fused=True)`` (what ``roundpipe train``
                     has always used; the default implementation where fused is
                     refused)
    bf16     bf16    the same (``torch.optim.AdamW`` keeps its moments in the
                     parameters' dtype)
    any      int8    :class:`roundpipe.optim.AdamW8bit` (torchao's ``AdamW8bit``)
    other            :class:`roundpipe.optim.AdamW` (torchao's AdamW step, moments
                     of the chosen dtype)
    =======  ======  =====================================================

    ``stochastic_round`` rounds each bf16 parameter's update stochastically (torchao's
    ``bf16_stochastic_round``; with bf16 states, this takes torchao's step instead of
    torch's) from random numbers of the optimizer's own, drawn from ``seed`` (default:
    ``torch.initial_seed()``): the same seed gives the same steps, bit for bit, and the
    process's generator is not used. Raises ``ValueError`` for an unknown ``states``,
    parameters of another dtype, or ``stochastic_round`` with fp32 masters, and
    ``ImportError`` where torchao is needed and missing.
    """
    if states not in STATES:
        raise ValueError(f"states={states!r}: expected one of {', '.join(map(repr, STATES))}")
    groups = [dict(g) if isinstance(g, dict) else g for g in params]
    master = _master_dtype(groups)
    if stochastic_round and master != "bf16":
        raise ValueError(
            f"stochastic_round=True rounds bf16 parameters, but these are {master}: "
            "pass bf16 masters (RoundPipe(..., optim_dtype=torch.bfloat16)) or "
            "stochastic_round=False"
        )
    options: _Options = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
    if states == master and not stochastic_round:
        try:
            return torch.optim.AdamW(groups, **options, fused=True)
        except (RuntimeError, ValueError):
            return torch.optim.AdamW(groups, **options)
    lean = _lean_module()
    rounding = {"bf16_stochastic_round": stochastic_round, "seed": seed}
    if states == "int8":
        return lean.AdamW8bit(groups, **options, **rounding)
    return lean.AdamW(groups, **options, state_dtype=STATES[states], **rounding)


def _master_dtype(groups: list) -> str:
    """The masters' dtype ("fp32" or "bf16"; "fp32" for no parameters); raises
    ``ValueError`` for another dtype or a mix."""
    dtypes: set[torch.dtype] = set()
    for group in groups:
        tensors = group["params"] if isinstance(group, dict) else [group]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        dtypes.update(t.dtype for t in tensors)
    if not dtypes:
        return "fp32"
    if len(dtypes) > 1 or not dtypes <= set(MASTERS):
        found = ", ".join(sorted(str(d) for d in dtypes))
        raise ValueError(
            f"make_adamw steps fp32 or bf16 masters, all of one dtype; these are {found}"
        )
    return MASTERS[dtypes.pop()]


def _lean_module():
    try:
        lean = importlib.import_module(f"{__package__}.lean")
    except ImportError as error:
        raise ImportError(
            f"these optimizer states need torchao ({error}): {install_hint('torchao')}"
        ) from error
    return lean

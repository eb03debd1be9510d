"""The dropout rule of a mixed device pool: a recompute must draw its forward's masks.

A backward job recomputes its layers' forward and must draw the masks the forward
drew. The seed is the same on every device (docs/design.md#random-numbers), but on
CUDA a dropout mask also depends on the launch grid, so on the GPU model: a forward on
one kind of card and its recompute on another draw different masks, and the gradients
are silently wrong. So a call whose schedule recomputes a layer that draws random
numbers on a device of another class than the one that ran its forward is refused.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.nn.modules.dropout import _DropoutNd

from ..core.schedule import JobKind, Schedule
from ..errors import MixedPoolDropoutError

__all__ = ["MixedPoolDropoutError", "check_recompute_classes", "layers_drawing_random"]

DROPOUT_ATTRIBUTES = ("attention_dropout", "dropout", "dropout_p", "attn_dropout")
"""Float attributes holding a dropout probability that a module applies functionally in
training (Hugging Face attention modules keep ``attention_dropout``)."""


def layers_drawing_random(modules: Sequence[nn.Module]) -> frozenset[int]:
    """Indices of the layers of ``modules`` (one per plan layer) that draw random numbers
    in their current mode: some submodule is training and is a dropout with ``p > 0`` or
    holds a dropout probability above 0 (:data:`DROPOUT_ATTRIBUTES`)."""
    return frozenset(
        index
        for index, module in enumerate(modules)
        if any(_draws_random(submodule) for submodule in module.modules())
    )


def _draws_random(module: nn.Module) -> bool:
    if not module.training:
        return False
    if isinstance(module, _DropoutNd):
        return module.p > 0
    for name in DROPOUT_ATTRIBUTES:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return True
    return False


def check_recompute_classes(
    schedule: Schedule, classes: Sequence[str], drawing: frozenset[int]
) -> None:
    """Raise :class:`MixedPoolDropoutError` if a backward job of ``schedule`` recomputes
    a layer of ``drawing`` on a device whose class (``classes[device]``) differs from
    that of the device whose forward job ran the layer."""
    if not drawing or len(set(classes)) <= 1:
        return
    if len(classes) != schedule.num_devices:
        raise ValueError(
            f"classes names {len(classes)} device classes for a schedule over "
            f"{schedule.num_devices} devices; give one per device of the pool"
        )
    forward_class: dict[int, str] = {}
    for job in schedule.forward_jobs:
        for layer in job.layers:
            forward_class[layer] = classes[job.device]
    mismatched: dict[tuple[str, str], list[int]] = {}
    for job in schedule.jobs:
        if job.kind is not JobKind.BACKWARD:
            continue
        for layer in job.layers:
            ran_on = forward_class.get(layer)
            if layer in drawing and ran_on is not None and ran_on != classes[job.device]:
                mismatched.setdefault((ran_on, classes[job.device]), []).append(layer)
    if mismatched:
        raise MixedPoolDropoutError(_message(mismatched))


def _message(mismatched: dict[tuple[str, str], list[int]]) -> str:
    cases = "; ".join(
        f"{_layers(layers)} ran forward on {forward!r} and would be recomputed on {backward!r}"
        for (forward, backward), layers in mismatched.items()
    )
    several = sum(len(layers) for layers in mismatched.values()) > 1
    these = "these layers" if several else "this layer"
    return (
        f"dropout on a pool of mixed devices: {cases}; a layer that draws random numbers "
        "(dropout) draws other masks on another kind of card, so its gradients would be "
        "silently wrong; set dropout to 0 (e.g. model.config.attention_dropout = 0 / "
        f"nn.Dropout p=0), use devices of one kind, or run {these} in the fused stage"
    )


def _layers(layers: list[int]) -> str:
    """``layer 3`` or ``layers 0-2, 5`` (consecutive runs joined)."""
    ordered = sorted(set(layers))
    runs: list[list[int]] = []
    for layer in ordered:
        if runs and layer == runs[-1][-1] + 1:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    text = ", ".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)
    return f"layer{'s' if len(ordered) > 1 else ''} {text}"

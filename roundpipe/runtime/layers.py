"""Running one of the user's layers on a device with device copies of its weights.

The user's modules stay untouched in host memory. For each (layer, device) we keep
a *shell*: a deep copy of the layer whose parameters and buffers are placeholders
on the ``meta`` device. Before running, the shell is bound to the device tensors
of the current stage; the autograd graph then refers to those tensors, so the
binding may change as soon as the call returns. A device runs its compute ops one
at a time, so one shell per device is never used by two ops at once.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import RoundPipeError


@dataclass(frozen=True)
class TensorSlot:
    """Where a parameter or buffer sits inside a layer: ``layer.<path>.<name>``."""

    path: str
    name: str
    uid: int  # id() of the host tensor; equal uids mean a tied tensor


def _slots(module: nn.Module, registry: str) -> list[TensorSlot]:
    slots = []
    for path, sub in module.named_modules(remove_duplicate=False):
        for name, tensor in getattr(sub, registry).items():
            if tensor is not None:
                slots.append(TensorSlot(path, name, id(tensor)))
    return slots


class LayerBinding:
    """One layer of the user's model and the machinery to run it on any device."""

    def __init__(self, index: int, name: str, module: nn.Module) -> None:
        self.index = index
        self.name = name
        self.module = module
        self.param_slots = _slots(module, "_parameters")
        self.buffer_slots = _slots(module, "_buffers")
        self.param_uids = list(dict.fromkeys(s.uid for s in self.param_slots))
        self.buffer_uids = list(dict.fromkeys(s.uid for s in self.buffer_slots))
        self._shells: dict[int, nn.Module] = {}
        self._targets: dict[int, _ShellTargets] = {}  # id(shell) -> where tensors go
        self._lock = threading.Lock()
        self._repr = f"layer {self.index} ({self.name}: {type(self.module).__name__})"

    def __repr__(self) -> str:
        return self._repr

    def shell(self, device_index: int) -> nn.Module:
        with self._lock:
            if device_index not in self._shells:
                shell = self._make_shell()
                self._targets[id(shell)] = _ShellTargets(self, shell)
                self._shells[device_index] = shell
            return self._shells[device_index]

    def _make_shell(self) -> nn.Module:
        memo: dict[int, object] = {}
        for tensor in list(self.module.parameters(recurse=True)):
            memo[id(tensor)] = nn.Parameter(
                torch.empty_like(tensor, device="meta"), requires_grad=tensor.requires_grad
            )
        for tensor in self.module.buffers(recurse=True):
            memo[id(tensor)] = torch.empty_like(tensor, device="meta")
        return copy.deepcopy(self.module, memo)

    def bind(
        self,
        shell: nn.Module,
        params: dict[int, torch.Tensor],
        buffers: dict[int, torch.Tensor],
        check_on_device=None,
    ) -> None:
        """Point the shell's parameters and buffers at device tensors (by host uid)."""
        targets = self._targets[id(shell)]
        for shell_module, host_module in targets.modules:
            shell_module.training = host_module.training
        for slot, owner in targets.params:
            tensor = params[slot.uid]
            if check_on_device is not None and not check_on_device(tensor):
                raise RoundPipeError(
                    f"{self}: parameter {slot.path or '.'}:{slot.name} is not in device "
                    "memory (its upload is missing)"
                )
            owner[slot.name] = tensor
        for slot, owner in targets.buffers:
            owner[slot.name] = buffers[slot.uid]

    def unbind(self, shell: nn.Module) -> None:
        """Drop the shell's references to device tensors so their memory can be freed."""
        targets = self._targets[id(shell)]
        for slot, owner in (*targets.params, *targets.buffers):
            owner[slot.name] = None

    def host_buffers(self) -> dict[int, torch.Tensor]:
        """The layer's buffers in host memory, by uid."""
        return {id(b): b for b in self.module.buffers()}


class _ShellTargets:
    """Where a shell's tensors go: found once, not on every bind."""

    def __init__(self, layer: LayerBinding, shell: nn.Module) -> None:
        self.modules = list(zip(shell.modules(), layer.module.modules(), strict=True))
        self.params = [(s, shell.get_submodule(s.path)._parameters) for s in layer.param_slots]
        self.buffers = [(s, shell.get_submodule(s.path)._buffers) for s in layer.buffer_slots]


def sequential_layers(model: nn.Module) -> list[LayerBinding]:
    """Each entry of an ``nn.Sequential`` is a layer; any other module is one layer.

    The entries are iterated as stored, so a module placed twice is two layers (its
    parameters are tied: they get the sum of both positions' gradients). A buffer
    cannot be shared by two layers: each layer writes its buffers back after it ran.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"RoundPipe wraps a torch.nn.Module (ideally an nn.Sequential of layers), "
            f"got {type(model).__name__}"
        )
    if isinstance(model, nn.Sequential):
        named = list(model._modules.items())  # not named_children(): it drops repeats
        if not named:
            raise ValueError("the nn.Sequential given to RoundPipe has no layers")
        for name, module in named:
            if not isinstance(module, nn.Module):
                raise TypeError(
                    f"entry {name!r} of the nn.Sequential is {type(module).__name__}, "
                    "not an nn.Module"
                )
    else:
        named = [(type(model).__name__, model)]
    layers = [LayerBinding(i, name, module) for i, (name, module) in enumerate(named)]
    _reject_shared_buffers(layers)
    return layers


def _reject_shared_buffers(layers: list[LayerBinding]) -> None:
    owner: dict[int, tuple[LayerBinding, TensorSlot]] = {}
    for layer in layers:
        for slot in layer.buffer_slots:
            first = owner.setdefault(slot.uid, (layer, slot))
            if first[0] is layer:
                continue
            earlier, earlier_slot = first
            buffer = ".".join(filter(None, (earlier_slot.path, earlier_slot.name)))
            if earlier.module is layer.module:
                what = (
                    f"the same {type(layer.module).__name__} module is entry {earlier.name!r} "
                    f"and entry {layer.name!r} of the nn.Sequential, and it holds the buffer "
                    f"{buffer!r}"
                )
            else:
                what = f"{earlier} and {layer} share the buffer {buffer!r}"
            raise ValueError(
                f"{what}: RoundPipe does not support a buffer used by two layers (each layer "
                "writes its buffers back after it runs, so the order of the updates would be "
                "lost); use separate modules, e.g. copy.deepcopy(module) for the second "
                "position (tying only their parameters if you need shared weights)"
            )

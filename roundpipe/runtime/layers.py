"""Running one of the user's layers on a device with device copies of its weights.

The user's modules stay untouched in host memory. For each (layer, device) we keep
a *shell*: a deep copy of the layer whose parameters and buffers are placeholders
on the ``meta`` device. Before running, the shell is bound to the device tensors
of the current stage; the autograd graph then refers to those tensors, so the
binding may change as soon as the call returns. A device runs its compute ops one
at a time, so one shell per device is never used by two ops at once. A module the user
changed since its shells were made gets new ones (docs/design.md#layer-shells).
"""

from __future__ import annotations

import copy
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

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
        self.tied_uids: tuple[int, ...] = ()
        """Its weights other layers use too (:func:`mark_tied`)."""
        self.buffer_uids = list(dict.fromkeys(s.uid for s in self.buffer_slots))
        self._shells: dict[object, nn.Module] = {}  # one per device (worker), not per GPU
        self._targets: dict[int, _ShellTargets] = {}  # id(shell) -> where tensors go
        self._lock = threading.Lock()
        self._repr = f"layer {self.index} ({self.name}: {type(self.module).__name__})"
        self._seen = _snapshot(module)

    def changed(self) -> bool:
        """Whether the module changed since its shells were made: an attribute, a hook,
        a submodule, a parameter or buffer (the training flag aside: set at each bind)."""
        return not _unchanged(self._seen)

    def refresh(self) -> None:
        """With nothing in flight: new shells for the module as it is now. A parameter
        or buffer replaced, added or removed is refused, naming it (the masters and an
        optimizer built over them hold the tensors as they were when wrapped)."""
        params, buffers = _slots(self.module, "_parameters"), _slots(self.module, "_buffers")
        self._refuse_new_tensors(self.param_slots, params, "parameter")
        self._refuse_new_tensors(self.buffer_slots, buffers, "buffer")
        with self._lock:
            self.param_slots, self.buffer_slots = params, buffers
            self._shells.clear()
            self._targets.clear()
            self._seen = _snapshot(self.module)

    def _refuse_new_tensors(self, old: list[TensorSlot], new: list[TensorSlot], what: str):
        old_uids, new_uids = {s.uid for s in old}, {s.uid for s in new}
        if old_uids == new_uids:
            return
        old_names = {self._name_of(s) for s in old}
        changes = [
            f"{what} {self._name_of(s)} was "
            + ("replaced by a new tensor" if self._name_of(s) in old_names else "added")
            for s in new
            if s.uid not in old_uids
        ]
        new_names = {self._name_of(s) for s in new}
        changes += [
            f"{what} {self._name_of(s)} was removed"
            for s in old
            if s.uid not in new_uids and self._name_of(s) not in new_names
        ]
        raise RuntimeError(
            f"{'; '.join(changes)} after the model was wrapped in RoundPipe; its masters "
            "(and an optimizer built over optim_parameters()) hold the tensors as they were. "
            "Write new values into the existing tensors instead (with torch.no_grad(): "
            "tensor.copy_(new), or load_state_dict), or wrap the changed model anew"
        )

    def _name_of(self, slot: TensorSlot) -> str:
        return ".".join(filter(None, (self.name, slot.path, slot.name)))

    def __repr__(self) -> str:
        return self._repr

    def shell(self, device: object) -> nn.Module:
        """The shell ``device`` binds and runs: one per device of the pool, so workers
        sharing a GPU (``cuda:0,0``) never bind one shell at once."""
        with self._lock:
            if device not in self._shells:
                shell = self._make_shell()
                self._targets[id(shell)] = _ShellTargets(self, shell)
                self._shells[device] = shell
            return self._shells[device]

    def _make_shell(self) -> nn.Module:
        memo: dict[int, object] = {}
        for tensor in list(self.module.parameters(recurse=True)):
            memo[id(tensor)] = nn.Parameter(
                torch.empty_like(tensor, device="meta"), requires_grad=tensor.requires_grad
            )
        for buffer in self.module.buffers(recurse=True):
            memo[id(buffer)] = torch.empty_like(buffer, device="meta")
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
        """Drop the shell's references to device tensors so their memory can be freed.

        A parameter that came back from a parametrization round trip as a buffer (the
        bound device tensor is not an ``nn.Parameter``, so ``remove_parametrizations``
        registers it as one: peft's LoRA on bare parameters, e.g. MoE routers) is put
        back in its place, so the next bind finds the shell as it was made."""
        targets = self._targets[id(shell)]
        for slot, owner in (*targets.params, *targets.buffers):
            owner[slot.name] = None
        for slot, buffers in targets.param_buffers:
            buffers.pop(slot.name, None)

    def host_buffers(self) -> dict[int, torch.Tensor]:
        """The layer's buffers in host memory, by uid."""
        return {id(b): b for b in self.module.buffers()}


class _ShellTargets:
    """Where a shell's tensors go: found once, not on every bind."""

    def __init__(self, layer: LayerBinding, shell: nn.Module) -> None:
        self.modules = list(zip(shell.modules(), layer.module.modules(), strict=True))
        # Where each tensor goes: the dicts nn.Module keeps them in (bound to device tensors,
        # which need not be nn.Parameters, and emptied with None).
        self.params: list[tuple[Any, dict[str, Any]]] = [
            (s, shell.get_submodule(s.path)._parameters) for s in layer.param_slots
        ]
        self.param_buffers: list[tuple[Any, dict[str, Any]]] = [
            (s, shell.get_submodule(s.path)._buffers) for s in layer.param_slots
        ]
        self.buffers: list[tuple[Any, dict[str, Any]]] = [
            (s, shell.get_submodule(s.path)._buffers) for s in layer.buffer_slots
        ]


_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _snapshot(module: nn.Module) -> list[tuple[nn.Module, dict]]:
    """What a shell copies of ``module``: each submodule's attributes, dicts (parameters,
    buffers, submodules, hooks) copied one level, so a later change is seen. The values
    are kept, so an object is never mistaken for a new one that got its id."""
    return [
        (
            sub,
            {
                key: dict(value) if isinstance(value, dict) else value
                for key, value in vars(sub).items()
            },
        )
        for sub in module.modules()
    ]


def _unchanged(snapshot: list[tuple[nn.Module, dict]]) -> bool:
    """Whether every submodule still holds what ``snapshot`` saw: plain values equal,
    anything else the same object (the training flag aside: set at every bind). A
    submodule added or replaced anywhere shows in its parent's ``_modules``."""
    for sub, saved in snapshot:
        now = vars(sub)
        if now.keys() != saved.keys():
            return False
        for key, old in saved.items():
            new = now[key]
            if new is old or key == "training":
                continue
            if isinstance(old, dict):
                if not isinstance(new, dict) or len(new) != len(old):
                    return False
                if any(
                    k is not j and k != j or a is not b
                    for (k, a), (j, b) in zip(new.items(), old.items(), strict=True)
                ):
                    return False
            elif not (type(old) in _PLAIN and type(new) is type(old) and new == old):
                return False
    return True


def check_layer_list(model: nn.Module, layers: list[LayerBinding]) -> None:
    """Refuse a wrapped ``nn.Sequential`` whose entries changed after wrapping: the plan,
    masters and optimizer were built for the layers as they were."""
    if not isinstance(model, nn.Sequential):
        return
    now = list(model._modules.items())
    if len(now) == len(layers) and all(
        name == layer.name and module is layer.module
        for (name, module), layer in zip(now, layers, strict=True)
    ):
        return
    then = {layer.name: layer.module for layer in layers}
    names = dict(now)
    changes = [
        f"entry {name!r} ({type(module).__name__}) was "
        + ("added" if name not in then else "replaced")
        for name, module in now
        if then.get(name) is not module
    ]
    changes += [f"entry {name!r} was removed" for name in then if name not in names]
    raise RuntimeError(
        f"the wrapped nn.Sequential changed after wrapping: {'; '.join(changes)}. RoundPipe "
        "runs the layers it wrapped (its plan, masters and optimizer were built for them); "
        "restore them, or wrap the changed model in a new RoundPipe"
    )


def sequential_layers(model: nn.Module) -> list[LayerBinding]:
    """Each entry of an ``nn.Sequential`` is a layer; any other module is one layer.

    The entries are iterated as stored, so a module placed twice is two layers (its
    parameters are tied: they get the sum of both positions' gradients, each use's on
    its own: :func:`mark_tied`). A buffer
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
    mark_tied(layers)
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


def mark_tied(layers: list[LayerBinding]) -> None:
    """Tell each layer which of its weights other layers use too (a tied embedding and
    LM head): those get a leaf of their own per layer on the device."""
    users = Counter(uid for layer in layers for uid in layer.param_uids)
    for layer in layers:
        layer.tied_uids = tuple(uid for uid in layer.param_uids if users[uid] > 1)

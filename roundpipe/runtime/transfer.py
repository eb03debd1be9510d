"""Moving pytrees of tensors between host and device, and pairing them with gradients.

An upload is prepared on the issuing thread (:class:`Upload`: its device memory is
taken then, as CUDA's caching allocator takes it when the host asks) and copied in its
stream op; everything else here runs inside stream ops. Tensors that appear several
times in a tree are moved once, so aliasing survives the trip (a gradient is then not
counted twice). Dataclass instances are tree nodes like tuples (:func:`register_dataclasses`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from typing import Any, cast

import torch
from torch.utils._pytree import SUPPORTED_NODES, register_pytree_node, tree_flatten, tree_unflatten

from ..devices.base import Device, Event, Slot, Stream


def _plain_tensors(tree: Any, leaf: type | tuple[type, ...] = torch.Tensor) -> bool:
    """``tree`` is ``((tensor, ...), {})``, what crosses most stage boundaries."""
    return (
        type(tree) is tuple
        and len(tree) == 2
        and type(tree[0]) is tuple
        and type(tree[1]) is dict
        and not tree[1]
        and all(isinstance(t, leaf) for t in tree[0])
    )


def _tensor_list(tree: Any, leaf: type | tuple[type, ...] = torch.Tensor) -> bool:
    """``tree`` is a list of tensors and Nones, what input gradients are."""
    return type(tree) is list and all(t is None or isinstance(t, leaf) for t in tree)


_REGISTER_LOCK = threading.Lock()


def register_dataclasses(tree: Any) -> None:
    """Make the type of every dataclass instance in ``tree`` a pytree node (once per
    type, for every tree walk in the process), so the tensors in its fields are copied,
    split, moved and paired with gradients like a tuple's instead of hiding in a leaf.

    An instance is taken apart into its attributes and rebuilt from them without
    calling ``__init__`` (as ``copy.copy`` does), so fields outside ``__init__`` and
    ``frozen`` or ``slots`` dataclasses survive the trip unchanged."""
    _flatten(tree)


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten`` after :func:`register_dataclasses`."""
    while True:
        leaves, spec = tree_flatten(tree)
        kinds = {type(leaf) for leaf in leaves if _is_dataclass_instance(leaf)}
        if not kinds:
            return leaves, spec
        for kind in kinds:  # then flatten again: their fields may hold dataclasses
            _register_dataclass(kind)


def _is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _register_dataclass(kind: type) -> None:
    with _REGISTER_LOCK:
        if kind in SUPPORTED_NODES:  # another thread was first, or the user registered it
            return
        register_pytree_node(
            kind,
            _dataclass_children,
            functools.partial(_rebuild_dataclass, kind),
            serialized_type_name=f"{kind.__module__}.{kind.__qualname__}",
        )


def _dataclass_children(value: Any) -> tuple[list[Any], tuple[str, ...]]:
    if hasattr(value, "__dict__"):
        names = tuple(vars(value))
    else:  # slots=True
        names = tuple(f.name for f in dataclasses.fields(value) if hasattr(value, f.name))
    return [getattr(value, name) for name in names], names


def _rebuild_dataclass(kind: Any, children: Any, names: tuple[str, ...]) -> Any:
    value = kind.__new__(kind)
    for name, child in zip(names, children, strict=True):
        object.__setattr__(value, name, child)  # frozen dataclasses too
    return value


def _map_unique(tree: Any, fn, leaf: type | tuple[type, ...] = torch.Tensor) -> Any:
    if _plain_tensors(tree, leaf):  # fast path, same result as _map_general
        moved: dict[int, Any] = {}
        for t in tree[0]:
            if id(t) not in moved:
                moved[id(t)] = fn(t)
        return tuple(moved[id(t)] for t in tree[0]), {}
    if _tensor_list(tree, leaf):  # fast path, same result as _map_general
        moved = {}
        for t in tree:
            if t is not None and id(t) not in moved:
                moved[id(t)] = fn(t)
        return [None if t is None else moved[id(t)] for t in tree]
    return _map_general(tree, fn, leaf)


def _map_general(tree: Any, fn, leaf: type | tuple[type, ...] = torch.Tensor) -> Any:
    """``fn`` applied once to each distinct ``leaf`` of any pytree, other leaves kept."""
    leaves, spec = _flatten(tree)
    moved: dict[int, Any] = {}
    out = []
    for item in leaves:
        if isinstance(item, leaf):
            if id(item) not in moved:
                moved[id(item)] = fn(item)
            out.append(moved[id(item)])
        else:
            out.append(item)
    return tree_unflatten(out, spec)


class TensorMeta:
    """A tensor's shape and dtype, standing in for it where only its size matters (what
    :meth:`Device.allocate` reads); made without a torch call."""

    __slots__ = ("dtype", "shape")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.shape, self.dtype = tensor.shape, tensor.dtype

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    def detach(self) -> TensorMeta:
        return self


_UNKNOWN = object()
_POLL_S = 0.01


class Shapes:
    """A downloaded value's shapes, known on the host as soon as the compute op that
    produced it was launched (its closure ran: on CUDA when it was issued, on the
    emulator before its modelled kernel time), before the value is on the host.

    The producing op passes its result to :meth:`announce`, then sets ``launched``
    (shared by the values of one op), also if it failed; a reader's :meth:`tree` is the
    value's tree with a :class:`TensorMeta` in place of each device tensor, or raises
    the producing op's error (``done``: its event)."""

    __slots__ = ("_launched", "_tree", "done")

    def __init__(self, launched: threading.Event) -> None:
        self._launched = launched
        self._tree: Any = _UNKNOWN
        self.done: Event | None = None  # the producing op's event, once it was recorded

    def announce(self, value: Any) -> None:
        self._tree = meta_tree(value)

    def tree(self) -> Any:
        # An op skipped after an earlier error on its stream never runs: then its event
        # completes (with the error) without an announcement.
        while not self._launched.wait(_POLL_S):
            if self.done is not None and self.done.query():
                break
        if self._tree is _UNKNOWN:  # the producing op failed: its event has the error
            assert self.done is not None
            self.done.synchronize()
            raise RuntimeError("a compute op ended without producing a downloaded value")
        return self._tree


def meta_tree(tree: Any) -> Any:
    """``tree`` with every tensor replaced by its :class:`TensorMeta` (aliasing kept)."""
    return _map_unique(tree, TensorMeta)


class Upload:
    """The upload of a host pytree to ``device`` on ``stream``, for the compute stream.

    Made on the issuing thread, which takes the device memory of every tensor now;
    :meth:`run`, inside the stream op, copies the tensors in and returns the device
    tree (floating tensors made grad leaves if ``requires_grad``). ``tree`` is the
    host value, or, with ``source``, its :func:`meta_tree`: the host value is then read
    from ``source`` when the op runs (a download that lands in the page-locked blocks
    of the pool, so the copy does not block)."""

    __slots__ = ("device", "nbytes", "pairs", "requires_grad", "source", "stream", "tree")

    def __init__(
        self,
        device: Device,
        stream: Stream,
        tree: Any,
        requires_grad: bool,
        source: Slot | None = None,
    ) -> None:
        self.device, self.stream, self.requires_grad = device, stream, requires_grad
        self.source = source
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (device, host or meta)
        self.nbytes = 0
        self.tree = _map_unique(tree, self._allocate, (torch.Tensor, TensorMeta))

    def _allocate(self, host: torch.Tensor | TensorMeta) -> torch.Tensor:
        # TensorMeta: the shape a producer announced (Shapes), standing in for the host
        # tensor the download will fill; it answers what allocate and the counts ask.
        host = cast(torch.Tensor, host.detach())
        tensor = self.device.allocate(host, self.stream)
        self.device.keep_alive(tensor, self.device.compute)
        self.pairs.append((tensor, host))
        self.nbytes += host.numel() * host.element_size()
        return tensor

    def pageable(self) -> bool:
        """Whether a copy reads pageable host memory (issuing it blocks the host)."""
        if self.source is not None:
            return False  # a download's page-locked block
        is_pinned = self.device.is_pinned
        return any(host.numel() and not is_pinned(host) for _, host in self.pairs)

    def run(self) -> Any:
        """Inside the upload op: copy every tensor in; the device tree."""
        device, stream = self.device, self.stream
        tensors = [tensor for tensor, _ in self.pairs]
        if self.source is None:
            hosts = [host for _, host in self.pairs]
        else:
            hosts = _unique_tensors(self.source.value)
            if [h.shape for h in hosts] != [t.shape for t in tensors]:
                raise RuntimeError(
                    "a downloaded value does not have the shapes its producer announced"
                )
        for tensor, host in zip(tensors, hosts, strict=True):
            device.copy_in(tensor, host, stream)
        if self.requires_grad:
            for tensor in tensors:
                if tensor.is_floating_point():
                    tensor.requires_grad_(True)
        return self.tree


def download_tree(device: Device, stream: Stream, tree: Any) -> Any:
    def move(tensor: torch.Tensor) -> torch.Tensor:
        device.keep_alive(tensor, stream)
        return device.to_host(tensor, stream)

    return _map_unique(tree, move)


def inplace_safe(tree: Any, clone_all: bool = False) -> Any:
    """``tree`` with tensors a layer may modify in place replaced by copies.

    Autograd forbids in-place ops on leaves that require grad, so those become
    (differentiable) clones; with ``clone_all`` every tensor is copied, for values
    that must survive a later layer modifying its input.
    """
    return _map_unique(tree, lambda t: t.clone() if clone_all or t.requires_grad else t)


def _unique_tensors(tree: Any) -> list[torch.Tensor]:
    if _plain_tensors(tree):
        leaves = list(tree[0])
    elif _tensor_list(tree):
        leaves = tree
    else:
        leaves = _flatten(tree)[0]
    seen: dict[int, torch.Tensor] = {}
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            seen.setdefault(id(leaf), leaf)
    return list(seen.values())


def tree_bytes(tree: Any) -> int:
    """Bytes of the unique tensors of ``tree`` (from their metadata: no device sync)."""
    return sum(t.numel() * t.element_size() for t in _unique_tensors(tree))


def grads_of_inputs(inputs: Any) -> list[torch.Tensor | None]:
    """Gradients of the unique tensors of ``inputs`` (None where there is none)."""
    return [t.grad if t.requires_grad else None for t in _unique_tensors(inputs)]


def pair_outputs_with_grads(
    outputs: Any, grads: list[torch.Tensor | None]
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Output tensors that need a backward, with their incoming gradients."""
    tensors = _unique_tensors(outputs)
    if len(tensors) != len(grads):
        raise RuntimeError(
            f"recompute produced {len(tensors)} tensors but {len(grads)} gradients came back; "
            "a layer's output structure differs between forward and recompute"
        )
    pairs = [
        (t, g) for t, g in zip(tensors, grads, strict=True) if t.requires_grad and g is not None
    ]
    return [t for t, _ in pairs], [g for _, g in pairs]

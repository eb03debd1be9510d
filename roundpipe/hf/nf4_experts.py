"""4-bit (NF4) stacked MoE experts: Qwen3-MoE's and GPT-OSS's experts modules over an NF4 base.

transformers keeps a MoE layer's experts as 3-d parameters (``gate_up_proj``,
``down_proj``: one 2-d weight per expert), not as linear layers, so :mod:`.nf4` leaves
them alone. :func:`quantize_experts` turns each supported experts module into its NF4
subclass in place: each expert's 2-d weight is quantized on its own (bitsandbytes'
format, blocks of 64 over that expert's flattened weight, as ``quantize_4bit`` would
quantize it), and the bytes and scales, one row per expert, are frozen parameters that
RoundPipe uploads as they are. The original class's forward runs unchanged: it reads
``self.gate_up_proj`` and ``self.down_proj``, which the subclass gives it dequantized on
the device that runs it (docs/design.md#4-bit-bases).

Which experts are dequantized follows what the forward indexes. transformers' default
implementation (``grouped_mm``, and ``batched_mm``) passes the whole stacked tensor to
its kernel, so the layer's experts are dequantized at once: the dense layer the device
holds without quantizing, from a quarter of the upload. The ``eager`` one indexes
``self.gate_up_proj[expert]`` for each expert its tokens are routed to; there the
subclass hands it a view that dequantizes only that expert. Either way autograd keeps
no dense weight for the backward: a saved-tensor hook swaps each dequantized weight
autograd saves for a note of how to dequantize it again (as bitsandbytes' ``Linear4bit``
dequantizes again in its backward), so a stage's graph holds NF4 experts only.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from dataclasses import dataclass, replace
from typing import cast

import torch
from torch import nn

from .checkpoint_layout import LoadItem
from .nf4 import dequantize, not_finite
from .nf4_format import BLOCK, CHUNK, absmax_numel, packed_numel, quantize_nf4, quantize_nf4_into
from .safetensors_io import CheckpointError, read_into
from .structure import named_modules_in_decoder_layers

SUPPORTED = {
    "Qwen3MoeExperts": ("gate_up_proj", "down_proj"),
    "GptOssExperts": ("gate_up_proj", "down_proj"),
}
"""Experts classes of the supported families and their stacked weights quantized (biases,
e.g. GPT-OSS ``gate_up_proj_bias``, stay in the model dtype, as NF4Linear keeps them)."""

_PER_EXPERT = (None, "eager")
"""``config._experts_implementation`` values whose forward indexes one expert at a time
(``None``: an experts module used on its own runs the original forward)."""


class NF4Experts(nn.Module):
    """Mixin of the NF4 subclass of an experts class (made by :func:`nf4_experts_class`).

    Each quantized weight ``W`` (``E × rows × cols`` in the model) is held as
    ``W_packed`` (uint8, ``E × packed_numel(rows·cols)``) and ``W_absmax`` (fp32,
    ``E × absmax_numel(rows·cols)``): row ``e`` is expert ``e``'s weight in NF4. Reading
    ``self.W`` gives what the original forward computes with: the dense dequantized
    tensor, or, for the ``eager`` implementation, an :class:`ExpertsView` that
    dequantizes the experts it is indexed with."""

    _nf4_weights: tuple[str, ...] = ()
    _nf4_shapes: dict[str, tuple[int, ...]]  # set by _make_nf4, with compute_dtype
    compute_dtype: torch.dtype

    def forward(self, *args, **kwargs):
        """The original class's forward (its experts implementation included), with the
        weights it saves for backward kept as NF4."""
        if not torch.is_grad_enabled():
            return super().forward(*args, **kwargs)
        made: dict[int, _Made] = {}
        outer = getattr(_local, "made", None)
        _local.made = made
        try:
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, made), _unpack):
                return super().forward(*args, **kwargs)
        finally:
            _local.made = outer

    def dequantized(self, name: str) -> torch.Tensor:
        """The whole stacked weight ``name`` in the model dtype, on the device of its
        NF4 data."""
        packed, absmax = self._nf4_data(name)
        return _made(_stacked, packed, absmax, self._nf4_shapes[name], self.compute_dtype)

    def expert_weight(self, name: str, expert: int) -> torch.Tensor:
        """Expert ``expert``'s 2-d weight of ``name``, dequantized (only that expert)."""
        packed, absmax = self._nf4_data(name)
        shape = self._nf4_shapes[name][1:]
        return _made(dequantize, packed[expert], absmax[expert], shape, self.compute_dtype)

    def _nf4_data(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        return getattr(self, f"{name}_packed"), getattr(self, f"{name}_absmax")

    def _weight_for_forward(self, name: str):
        implementation = getattr(self.config, "_experts_implementation", None)
        if implementation in _PER_EXPERT:
            return ExpertsView(self, name)
        return self.dequantized(name)

    def extra_repr(self) -> str:
        shapes = ", ".join(f"{n}={list(self._nf4_shapes[n])}" for n in self._nf4_weights)
        return f"{shapes}, compute_dtype={self.compute_dtype}, nf4"


class ExpertsView:
    """A stacked NF4 weight as the eager forward indexes it: ``view[expert]`` is that
    expert's dense 2-d weight, dequantized when indexed."""

    def __init__(self, experts: NF4Experts, name: str) -> None:
        self._experts, self._name = experts, name
        self.shape = torch.Size(experts._nf4_shapes[name])
        self.dtype = experts.compute_dtype
        self.device = experts._nf4_data(name)[0].device

    def __getitem__(self, index) -> torch.Tensor:
        if isinstance(index, torch.Tensor) and index.dim() == 0:
            index = int(index)
        if isinstance(index, int):
            return self._experts.expert_weight(self._name, index)
        return self._experts.dequantized(self._name)[index]

    def __len__(self) -> int:
        return self.shape[0]


_local = threading.local()
"""``made``: the weights dequantized by the experts forward running on this thread."""


@dataclass(frozen=True)
class _Made:
    weight: weakref.ref
    again: functools.partial


@dataclass(frozen=True)
class _Again:
    """What a saved-tensor hook keeps of a dequantized weight (or a view of it)."""

    again: functools.partial
    size: torch.Size
    stride: tuple[int, ...]
    offset: int | torch.SymInt


def _stacked(packed, absmax, shape, dtype) -> torch.Tensor:
    """A stacked weight from its rows of NF4 data, one per expert."""
    if math.prod(shape[1:]) % BLOCK == 0:  # blocks never straddle experts: one flat weight
        return dequantize(packed.reshape(-1), absmax.reshape(-1), shape, dtype)
    return torch.stack(
        [dequantize(p, a, shape[1:], dtype) for p, a in zip(packed, absmax, strict=True)]
    )


def _made(function, *args) -> torch.Tensor:
    """``function(*args)``, noted (while an experts forward records) as a weight to
    dequantize again, from the same NF4 tensors, if autograd saves it: the module's
    attributes may point elsewhere by the time its backward runs."""
    weight = function(*args)
    again = functools.partial(function, *args)
    made = getattr(_local, "made", None)
    if made is not None and weight.numel():
        made[weight.untyped_storage().data_ptr()] = _Made(weakref.ref(weight), again)
    return weight


def _pack(made: dict[int, _Made], tensor: torch.Tensor):
    """A note to dequantize again for a tensor that is (a view of) a weight this forward
    dequantized and still holds; any other tensor as it is. The weak reference tells a
    live weight from a tensor that reuses the memory of a freed one."""
    if not tensor.numel() or tensor.is_meta:
        return tensor
    entry = made.get(tensor.untyped_storage().data_ptr())
    if entry is None:
        return tensor
    weight = entry.weight()
    if weight is None or weight.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr():
        return tensor
    return _Again(entry.again, tensor.size(), tensor.stride(), tensor.storage_offset())


def _unpack(saved):
    if isinstance(saved, _Again):
        return saved.again().as_strided(saved.size, saved.stride, saved.offset)
    return saved


def _weight_property(name: str) -> property:
    return property(
        lambda self: self._weight_for_forward(name),
        doc=f"``{name}`` as the original forward reads it, dequantized from NF4.",
    )


@functools.cache
def nf4_experts_class(base: type[nn.Module]) -> type[nn.Module]:
    """The NF4 subclass of the experts class ``base``: its forward is ``base``'s, its
    quantized weights are properties that dequantize. Registered in this module under
    its name (``NF4Qwen3MoeExperts``, …) so that pickle finds it."""
    weights = SUPPORTED[base.__name__]
    namespace: dict[str, object] = {name: _weight_property(name) for name in weights}
    namespace.update(__module__=__name__, _nf4_weights=weights)
    cls = type(f"NF4{base.__name__}", (NF4Experts, base), namespace)
    globals()[cls.__name__] = cls
    return cls


def quantize_experts(model: nn.Module, items: list[LoadItem]) -> list[LoadItem]:
    """Quantize the stacked weights of every supported experts module inside the
    decoder layers of ``model`` (on the meta device) from their checkpoint tensors, and
    return the items left to load. Each expert is read into a small buffer in the model
    dtype (stacked from its per-expert tensors where the checkpoint stores them so) and
    quantized into its row: the dense stacked tensor never exists."""
    experts = _decoder_experts(model)
    rest = []
    for item in items:
        module_name, _, attr = item.target.names[0].rpartition(".")
        module = experts.get(module_name)
        if module is None or attr not in _weights_of(module) or len(item.target.names) != 1:
            rest.append(item)
            continue
        if not isinstance(module, NF4Experts):
            _make_nf4(module, item.target.dtype)
        packed, absmax = quantize_expert_pieces(item)
        _set_nf4(module, attr, packed, absmax, tuple(item.target.shape))
    for name, module in experts.items():
        dense = [w for w in _weights_of(module) if w in module._parameters]
        if dense and isinstance(module, NF4Experts):  # e.g. one tied: never half quantized
            raise ValueError(
                f"cannot quantize {name}: its weights {dense} are not stored as one tensor "
                "each (or one per expert) in the checkpoint; use quantize=None"
            )
    return rest


def quantize_experts_module(module: nn.Module) -> nn.Module:
    """``module`` (a supported experts module with dense host weights) turned into its
    NF4 subclass in place, each expert's weights quantized as they are (in their own
    dtype); its other parameters are kept. Returns ``module``."""
    names = _weights_of(module)
    weights = {name: cast(nn.Parameter, module._parameters[name]).detach() for name in names}
    _make_nf4(module, weights[names[0]].dtype)
    for name, weight in weights.items():
        rows = [quantize_nf4(expert) for expert in weight]
        packed = torch.stack([p for p, _ in rows])
        absmax = torch.stack([a for _, a in rows])
        _set_nf4(module, name, packed, absmax, tuple(weight.shape))
    return module


def quantize_expert_pieces(item: LoadItem) -> tuple[torch.Tensor, torch.Tensor]:
    """The stacked weight of ``item`` as NF4, one row of bytes and one of scales per
    expert, read one expert at a time into a buffer in the model dtype. Where blocks do
    not straddle experts (an expert a whole number of blocks: real models), quantizing
    several experts' weights one after the other is quantizing each, so the buffer
    holds as many as fit in ``CHUNK`` elements and they are quantized together (small
    calls cost 1.5 times as much a parameter)."""
    experts, *expert_shape = item.target.shape
    numel = math.prod(expert_shape)
    packed = torch.empty(experts, packed_numel(numel), dtype=torch.uint8)
    absmax = torch.empty(experts, absmax_numel(numel), dtype=torch.float32)
    group = max(1, CHUNK // numel) if numel % BLOCK == 0 else 1
    buffer = torch.empty((min(group, experts), *expert_shape), dtype=item.target.dtype)
    by_expert: dict[int, list] = {}
    for piece in item.pieces if item.whole is None else ():
        by_expert.setdefault(piece.index[0], []).append(piece)
    for first in range(0, experts, group):
        count = min(group, experts - first)
        for j in range(count):
            _read_expert(item, by_expert, first + j, buffer[j])
        flat = buffer[:count].reshape(-1)
        rows = slice(first, first + count)
        for start in range(0, flat.numel(), CHUNK):
            try:
                quantize_nf4_into(
                    flat[start : start + CHUNK], packed[rows].view(-1), absmax[rows].view(-1), start
                )
            except ValueError:  # a block scale is not finite
                raise _not_finite(item, by_expert, first, buffer[:count]) from None
    return packed, absmax


def _not_finite(
    item: LoadItem, by_expert: dict, first: int, experts: torch.Tensor
) -> CheckpointError:
    """:func:`.nf4.not_finite` for the checkpoint tensor holding the first element
    that is not finite of ``experts`` (experts ``first …`` of ``item``, as read)."""
    expert = int((~torch.isfinite(experts.flatten(1))).any(dim=1).nonzero()[0])
    values = experts[expert]
    if item.whole is not None:
        return not_finite(item.whole, values, (first + expert) * values.numel())
    piece = next(p for p in by_expert[first + expert] if not values[p.index[1:]].isfinite().all())
    return not_finite(piece.stored, values[piece.index[1:]], 0)


def _read_expert(item: LoadItem, by_expert: dict, expert: int, out: torch.Tensor) -> None:
    """Expert ``expert``'s weight of ``item`` into ``out``: its slice of the stacked
    checkpoint tensor, or its per-expert tensors (gate and up stacked as transformers
    stacks them)."""
    whole = item.whole
    if whole is None:
        for piece in by_expert[expert]:
            read_into(piece.stored, out[piece.index[1:]])
        return
    numel, size = out.numel(), whole.dtype.itemsize
    part = replace(
        whole,
        shape=tuple(out.shape),
        offset=whole.offset + expert * numel * size,
        nbytes=numel * size,
    )
    read_into(part, out)


def check_target_parameters(lora) -> None:
    """Refuse LoRA on the stacked experts themselves (peft's ``target_parameters``): over
    an NF4 base they are not parameters any more, and stay frozen."""
    quantized = {w for weights in SUPPORTED.values() for w in weights}
    named = [
        t
        for t in getattr(lora, "target_parameters", None) or ()
        if t.rpartition(".")[2] in quantized
    ]
    if named:
        raise ValueError(
            f"target_parameters={named} puts LoRA on stacked MoE experts, which "
            "quantize='nf4' keeps frozen in 4 bits: target linear layers (target_modules), "
            "or use quantize=None"
        )


def nf4_expert_modules(model: nn.Module) -> dict[str, NF4Experts]:
    """``{name: module}`` for every NF4 experts module of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, NF4Experts)}


def _make_nf4(module: nn.Module, dtype: torch.dtype) -> None:
    """Turn ``module`` into its NF4 subclass in place (its other attributes, biases and
    config stay as they are)."""
    # a class is hashable; mypy checks type[Module] against Hashable as an instance
    module.__class__ = nf4_experts_class(type(module))  # type: ignore[arg-type]
    nf4 = cast(NF4Experts, module)
    nf4.compute_dtype = dtype
    nf4._nf4_shapes = {}


def _set_nf4(module, name, packed, absmax, shape) -> None:
    del module._parameters[name]
    module.register_parameter(f"{name}_packed", nn.Parameter(packed, requires_grad=False))
    module.register_parameter(f"{name}_absmax", nn.Parameter(absmax, requires_grad=False))
    module._nf4_shapes[name] = shape


def _weights_of(module: nn.Module) -> tuple[str, ...]:
    if isinstance(module, NF4Experts):
        return module._nf4_weights
    return SUPPORTED[type(module).__name__]


def _decoder_experts(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: module}`` for every supported experts module inside a decoder layer."""
    return {
        name: module
        for name, module in named_modules_in_decoder_layers(model)
        if type(module).__name__ in SUPPORTED
    }

"""4-bit (NF4) frozen linear layers for LoRA over a quantized base.

:class:`NF4Linear` holds one linear layer's weight as NF4 bytes and fp32 block scales
(:mod:`.nf4_format`), both frozen parameters: RoundPipe uploads frozen parameters as
they are, so a stage's upload is the quantized bytes, and the layer dequantizes on
whatever device runs it, in its forward (docs/design.md#4-bit-bases).
:func:`quantize_linears` makes them while a checkpoint loads, streaming each weight
through a small buffer, so the dense weights never exist in host memory at once.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import replace

import torch
from torch import nn
from torch.nn import functional as F

from .checkpoint_layout import LoadItem
from .nf4_format import (
    BLOCK,
    CHUNK,
    absmax_numel,
    dequantize_nf4,
    packed_numel,
    quantize_nf4,
    quantize_nf4_into,
)
from .safetensors_io import CheckpointError, StoredTensor, read_into
from .structure import named_modules_in_decoder_layers

QUANTIZE_CHOICES = (None, "nf4")
"""The values ``from_pretrained(quantize=...)`` takes."""


class NF4Linear(nn.Module):
    """The frozen base of one linear layer: ``F.linear(x, W, bias)`` with ``W`` held as
    NF4 (``packed_weight``: uint8, two elements a byte; ``absmax``: fp32, one per 64
    elements) and dequantized to ``compute_dtype`` where the layer runs.

    The quantized data are frozen parameters, not buffers: RoundPipe writes buffers
    back to the host after a forward, and only uploads frozen parameters. The backward
    dequantizes again instead of keeping the dense weight for it (as bitsandbytes'
    ``Linear4bit`` does), so a stage holds its dense weights one layer at a time."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        compute_dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if not compute_dtype.is_floating_point:
            raise TypeError(f"compute_dtype must be a floating point dtype, got {compute_dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.compute_dtype = compute_dtype
        numel = in_features * out_features
        packed = torch.empty(packed_numel(numel), dtype=torch.uint8, device=device)
        self.packed_weight = _frozen(packed)
        self.absmax = _frozen(torch.empty(absmax_numel(numel), dtype=torch.float32, device=device))
        if bias:
            self.bias = _frozen(torch.empty(out_features, dtype=compute_dtype, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def holding(
        cls, linear: nn.Linear, packed: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype
    ) -> NF4Linear:
        """A layer shaped as ``linear`` holding the NF4 data ``packed`` and ``absmax``
        of its weight, computing in ``dtype``; its bias, if it has one, is still to be
        filled (on the ``meta`` device)."""
        layer = cls(
            linear.in_features,
            linear.out_features,
            bias=linear.bias is not None,
            compute_dtype=dtype,
            device="meta",
        )
        layer.packed_weight, layer.absmax = _frozen(packed), _frozen(absmax)
        return layer

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> NF4Linear:
        """``linear`` quantized (its weight in its own dtype, as bitsandbytes quantizes
        the weight it is given); the bias is kept as it is."""
        weight = linear.weight.detach()
        layer = cls.holding(linear, *quantize_nf4(weight), weight.dtype)
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return layer

    def dequantized_weight(self) -> torch.Tensor:
        """The weight (out × in, ``compute_dtype``) on the device of the NF4 data."""
        shape = (self.out_features, self.in_features)
        return dequantize(self.packed_weight, self.absmax, shape, self.compute_dtype)

    @property
    def weight(self) -> torch.Tensor:
        """:meth:`dequantized_weight`, for model code that reads a linear layer's weight
        itself (Jamba's and LongCat's layers do); no gradient reaches it."""
        return self.dequantized_weight()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.out_features, self.in_features)
        out = _NF4Matmul.apply(x, self.packed_weight, self.absmax, shape, self.compute_dtype)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, compute_dtype={self.compute_dtype}, nf4"
        )


class _NF4Matmul(torch.autograd.Function):
    """``x @ W.T`` that saves the NF4 data, not ``W``, for its backward (only the input
    gets a gradient: the base is frozen)."""

    @staticmethod
    def forward(ctx, x, packed, absmax, shape, dtype):
        ctx.save_for_backward(packed, absmax)
        ctx.shape, ctx.dtype = shape, dtype
        return F.linear(x, dequantize(packed, absmax, shape, dtype))

    @staticmethod
    def backward(ctx, grad):
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        packed, absmax = ctx.saved_tensors
        weight = dequantize(packed, absmax, ctx.shape, ctx.dtype)
        return grad @ weight.to(grad.dtype), None, None, None, None


def dequantize(packed, absmax, shape, dtype) -> torch.Tensor:
    """The weight ``NF4Linear`` computes with: bitsandbytes' CUDA kernel where it is
    installed and the data are on a GPU (the same values), else
    :func:`.nf4_format.dequantize_nf4`."""
    if packed.is_cuda:
        kernel = _bitsandbytes_dequantize()
        if kernel is not None:
            return kernel(packed, absmax, BLOCK, "nf4", list(shape), dtype)
    return dequantize_nf4(packed, absmax, shape, dtype)


@functools.cache
def _bitsandbytes_dequantize():
    """``torch.ops.bitsandbytes.dequantize_4bit``, or None without bitsandbytes (it is
    imported only when a CUDA layer first runs: the import is slow and loud)."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    try:
        import bitsandbytes  # noqa: F401  (registers the ops)
    except Exception:  # noqa: BLE001 - a broken install falls back to torch ops
        return None
    return torch.ops.bitsandbytes.dequantize_4bit.default


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def quantize_linears(model: nn.Module, items: list[LoadItem]) -> list[LoadItem]:
    """Replace each ``nn.Linear`` inside the decoder layers of ``model`` (on the meta
    device) by an :class:`NF4Linear` quantized from its checkpoint tensor, and return
    the items left to load (biases included: they keep their names). Embeddings,
    norms and the LM head stay in the model dtype, as transformers' bitsandbytes
    integration leaves them. A weight that is tied to another tensor or assembled from
    several stays dense."""
    linears = _decoder_linears(model)
    rest = []
    for item in items:
        target = item.target
        found = linears.get(target.names[0])
        if found is None or len(target.names) != 1 or item.whole is None:
            rest.append(item)
            continue
        parent, attr, linear = found
        packed, absmax = quantize_stored(item.whole, target.dtype)
        setattr(parent, attr, NF4Linear.holding(linear, packed, absmax, target.dtype))
    return rest


def quantize_stored(stored: StoredTensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint tensor as NF4, read ``CHUNK`` elements at a time and converted to
    ``dtype`` (the model dtype, which is what transformers quantizes) before quantizing."""
    numel = math.prod(stored.shape)
    packed = torch.empty(packed_numel(numel), dtype=torch.uint8)
    absmax = torch.empty(absmax_numel(numel), dtype=torch.float32)
    buffer = torch.empty(min(numel, CHUNK), dtype=dtype)
    size = stored.dtype.itemsize
    for start in range(0, numel, CHUNK):
        count = min(CHUNK, numel - start)
        piece = replace(
            stored, shape=(count,), offset=stored.offset + start * size, nbytes=count * size
        )
        read_into(piece, buffer[:count])
        try:
            quantize_nf4_into(buffer[:count], packed, absmax, start)
        except ValueError:  # a block scale is not finite
            raise not_finite(stored, buffer[:count], start) from None
    return packed, absmax


def not_finite(stored: StoredTensor, values: torch.Tensor, first: int) -> CheckpointError:
    """The error for checkpoint tensor ``stored`` whose flat elements ``first …``, read
    as ``values`` (in the model dtype), hold NaN or inf: bitsandbytes would quantize
    their block to garbage (its scale is not finite), so the tensor and the element are
    named. A finite element the model dtype cannot hold (fp16 overflow) says so."""
    position = first + int((~torch.isfinite(values.reshape(-1))).nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(position), stored.shape)]
    size = stored.dtype.itemsize
    element = torch.empty(1, dtype=stored.dtype)
    read_into(
        replace(stored, shape=(1,), offset=stored.offset + position * size, nbytes=size), element
    )
    value = float(element)
    where = f"tensor {stored.name!r} in {stored.path}"
    if math.isfinite(value):
        return CheckpointError(
            f"{where} holds {value:g} at {index}, which is inf in {values.dtype} (the model's "
            "dtype): NF4 cannot quantize it; load the model in bfloat16 or float32"
        )
    held = "NaN" if math.isnan(value) else f"{value}"
    return CheckpointError(
        f"{where} holds {held} at {index}: NF4 cannot quantize a weight that is not finite "
        "(bitsandbytes would quantize its block to garbage); the checkpoint is damaged: "
        "re-download or re-save it"
    )


def _decoder_linears(model: nn.Module) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """``{weight name: (parent, attribute, linear)}`` for every ``nn.Linear`` inside a
    decoder layer of ``model``."""
    found = {}
    for parent_name, parent in named_modules_in_decoder_layers(model):
        for attr, child in parent.named_children():
            if isinstance(child, nn.Linear):
                name = f"{parent_name}.{attr}" if parent_name else attr
                found[f"{name}.weight"] = (parent, attr, child)
    return found

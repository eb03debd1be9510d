"""Host-memory home of the training state (docs/design.md#stateless-devices).

For every unique parameter of the wrapped model: the user's parameter (model dtype,
what devices upload), and for a trainable one the *master* that the user's optimizer
updates, with its accumulated gradient: an fp32 (``optim_dtype``) copy of a half
precision parameter, or, when ``optim_dtype`` is the model's dtype, the parameter's own
tensor (docs/design.md#host-memory).
Which weights a call uploads is decided by :mod:`.versions`.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .layers import LayerBinding

_HALF_TYPES = (torch.float16, torch.bfloat16)


class ParamEntry:
    """One unique parameter of the wrapped model (tied parameters share an entry)."""

    def __init__(self, name: str, param: nn.Parameter, optim_dtype: torch.dtype | None) -> None:
        self.name = name
        self.param = param
        self.trainable = param.requires_grad
        self.optim_dtype = optim_dtype or (
            torch.float32 if param.dtype in _HALF_TYPES else param.dtype
        )
        self.master: nn.Parameter | None = None
        self.aliased = self.trainable and self.optim_dtype == param.dtype
        """Whether the master is the model's own tensor (no second copy): its dtype is
        the model's. Steps then write a weight version in place
        (:meth:`~.versions.WeightVersions.prepare`)."""
        self.owned = True
        """Whether this node keeps the master (always, but on several nodes: its share)."""
        self.local_grad: torch.Tensor | None = None
        """On several nodes: this node's gradient since the last step, before the
        reduction across nodes adds the sum into the owner's ``master.grad``."""
        self.seen = (param.data_ptr(), param._version)
        self.pinned_storage = 0
        """The address of the storage the pool page-locked for it (given back when the
        user replaces it: :meth:`~roundpipe.devices.base.DevicePool.unpin`)."""

    def pin(self, pin: Callable[[torch.Tensor], torch.Tensor]) -> int:
        """Page-lock the parameter's tensor with ``pin`` (its data becomes the pinned copy
        where ``pin`` makes one); returns the address of the storage pinned before (0:
        none), whose hold the caller gives back."""
        held = self.pinned_storage
        pinned = pin(self.param.data)
        if pinned is not self.param.data:
            self.param.data = pinned
        self.pinned_storage = self.param.untyped_storage().data_ptr()
        return held

    def externally_modified(self) -> bool:
        """Whether the user wrote into (or replaced) the parameter since we last looked."""
        return (self.param.data_ptr(), self.param._version) != self.seen

    def mark_seen(self) -> None:
        self.seen = (self.param.data_ptr(), self.param._version)

    def show_grad(self) -> None:
        """Show the master's accumulated gradient on the user's parameter."""
        grad = None if self.master is None else self.master.grad
        self.param.grad = None if grad is None else grad.to(self.param.dtype, copy=True)


def parameter_names(module: nn.Module) -> dict[int, str]:
    """Each parameter's name in ``module``, by ``id`` (a tied one: its first name)."""
    names: dict[int, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), name)
    return names


class ParameterStore:
    """Master copies, gradients and upload buffers for all layers' parameters."""

    def __init__(
        self,
        layers: list[LayerBinding],
        named_params: dict[int, str],
        optim_dtype: torch.dtype | None,
        pin,
    ) -> None:
        self.entries: dict[int, ParamEntry] = {}
        for layer in layers:
            for tensor in layer.module.parameters():
                if id(tensor) not in self.entries:
                    name = named_params.get(id(tensor), f"{layer.name}.?")
                    self.entries[id(tensor)] = ParamEntry(name, tensor, optim_dtype)
        for entry in self.entries.values():
            entry.pin(pin)
            entry.mark_seen()
        self.user_param_ids = frozenset(id(entry.param) for entry in self.entries.values())
        self._grad_lock = threading.Lock()
        self.sharded = False

    def shard(self, owned: frozenset[int]) -> None:
        """Keep masters only for the trainable parameters in ``owned`` (uids), and collect
        every gradient in ``local_grad`` for the reduction across nodes."""
        for uid, entry in self.entries.items():
            entry.owned = uid in owned
            if not entry.owned:
                entry.master = None
        self.sharded = True

    # -- master copies -------------------------------------------------------------

    def ensure_masters(self) -> None:
        for entry in self.entries.values():
            if entry.trainable and entry.owned and entry.master is None:
                if entry.aliased:  # ``.data``: the optimizer's writes bump no user version
                    master = entry.param.data
                else:
                    master = entry.param.detach().to(entry.optim_dtype, copy=True)
                entry.master = nn.Parameter(master, requires_grad=True)

    def masters(self) -> Iterator[tuple[str, nn.Parameter]]:
        self.ensure_masters()
        for entry in self.entries.values():
            if entry.master is not None:
                yield entry.name, entry.master

    def check_trainable(self) -> None:
        """Refuse what PyTorch would honour and the masters cannot: parameters (or their
        masters) frozen or unfrozen after wrapping (masters, gradient traffic and uploads
        were set up for ``requires_grad`` as it was then), and gradient hooks on the
        wrapped model's parameters (they never get a gradient: the masters do)."""
        for entry in self.entries.values():
            master = entry.master
            if entry.param.requires_grad != entry.trainable or (
                master is not None and not master.requires_grad
            ):
                now = "frozen" if entry.trainable else "unfrozen"
                raise RuntimeError(
                    f"parameter {entry.name} (or its master in optim_parameters()) was "
                    f"{now} after the model was wrapped in RoundPipe; set requires_grad "
                    "before wrapping it"
                )
            if _has_grad_hooks(entry.param):
                raise RuntimeError(
                    f"a gradient hook is registered on parameter {entry.name} of the "
                    "wrapped model, which never receives a gradient under RoundPipe (its "
                    "master does): register it on the master, pipe.optim_parameters() "
                    "(pipe.optim_named_parameters() by name), and remove this one"
                )

    def trainable(self, uid: int) -> bool:
        return self.entries[uid].trainable

    def externally_modified(self) -> bool:
        """Whether the user wrote into a parameter's tensor since it was last adopted."""
        return any(entry.externally_modified() for entry in self.entries.values())

    # -- gradients -----------------------------------------------------------------

    def accumulate_grad(self, uid: int, grad: torch.Tensor, scale: float | None = None) -> None:
        """Add a downloaded gradient, unscaled by the loss ``scale`` it was computed with.

        Bit-identical to the plain formula ``master.grad += grad.to(optim_dtype) / scale``
        (:func:`_reference_grad`), but without a full-size temporary. A torch op whose
        operands differ in dtype first converts the lower-precision one into a full-size
        copy on CPU, so a half-precision gradient goes through an fp32 scratch chunk at a
        time (its share per intra-op thread stays in L2); memory sees each element read
        once and the accumulator written once. The division becomes ``alpha=1/scale`` of
        the ``add_`` when that is exact for every value of ``grad``'s dtype — ``scale`` a
        power of two (as GradScaler's are) small enough that no quotient underflows —
        else a multiply by ``1/scale`` in the scratch where that is exact (a power of
        two), else the same division (a non-power-of-two ``x * (1/scale)`` can differ
        from ``x / scale`` in the last bit). The whole update runs under the lock.
        """
        entry = self.entries[uid]
        assert entry.trainable and (entry.master is not None or self.sharded)
        with self._grad_lock:  # several completer threads may accumulate into one master
            master = entry.master
            acc = entry.local_grad if master is None or self.sharded else master.grad
            if acc is None:
                acc = _unscaled_copy(grad, entry.optim_dtype, scale)
                if master is None or self.sharded:
                    entry.local_grad = acc
                else:
                    master.grad = acc
            elif acc.dtype != entry.optim_dtype or not _flat_pair(acc, grad):
                acc.add_(_reference_grad(grad, entry.optim_dtype, scale))
            else:
                _add_unscaled(acc, grad, scale)

    def add_reduced_grad(self, uid: int, grad: torch.Tensor) -> None:
        """On several nodes: add ``grad``, this node's share of the gradient summed across
        nodes (``optim_dtype``, shaped like the parameter), into the master's ``.grad``;
        with none yet, ``grad`` becomes it."""
        entry = self.entries[uid]
        assert entry.master is not None and grad.dtype == entry.optim_dtype
        with self._grad_lock:
            if entry.master.grad is None:
                entry.master.grad = grad
            else:
                entry.master.grad.add_(grad)

    def scale_grads(self, factor: float) -> None:
        """Multiply every accumulated gradient by ``factor`` (to hand them to a GradScaler)."""
        with torch.no_grad():
            for _, master in self.masters():
                if master.grad is not None:
                    master.grad.mul_(factor)

    def discard_grads(self, set_to_none: bool = True) -> None:
        """Drop the gradients the next step would apply (this node's too, on several);
        with ``set_to_none=False`` a master that had a gradient keeps zeros instead."""
        with self._grad_lock:
            for _, master in self.masters():
                kept = not set_to_none and master.grad is not None
                master.grad = torch.zeros_like(master) if kept else None
            for entry in self.entries.values():
                entry.local_grad = None

    def restore_masters(self, values: dict[str, torch.Tensor]) -> None:
        """Set the masters, and their gradients (``grad/<name>``, absent: none), to
        saved full-precision ``values``."""
        with torch.no_grad(), self._grad_lock:
            for name, master in self.masters():
                master.copy_(values[name])
                grad = values.get(f"grad/{name}")
                master.grad = None if grad is None else grad.clone()

    def take_local_grad(self, uid: int) -> torch.Tensor | None:
        """This node's gradient of ``uid`` since the last step, handed over (sharded)."""
        entry = self.entries[uid]
        with self._grad_lock:
            grad, entry.local_grad = entry.local_grad, None
        return grad


# -- fused gradient accumulation (ParameterStore.accumulate_grad) ---------------------

_CHUNK_PER_THREAD = 8 * 32768
"""Scratch chunk elements per intra-op thread (32768 is ATen's grain size): each
thread's share of the chunk (1 MiB in fp32) stays in its cache between the ops."""

_scratch = threading.local()  # one scratch per completer thread, reused


def _reference_grad(grad: torch.Tensor, dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    """A new ``grad.to(dtype) / scale``: the formula the fused paths reproduce bit for bit."""
    out = grad.to(dtype, copy=True)
    if scale is not None:
        out.div_(scale)
    return out


def _flat(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.layout == torch.strided and t.is_contiguous()


def _flat_pair(acc: torch.Tensor, grad: torch.Tensor) -> bool:
    return acc.shape == grad.shape and _flat(acc) and _flat(grad)


def _chunks(*tensors: torch.Tensor) -> Iterator[tuple[torch.Tensor, ...]]:
    """Matching flat chunks of equally long contiguous tensors."""
    size = max(1, min(_CHUNK_PER_THREAD * max(1, torch.get_num_threads()), tensors[0].numel()))
    return zip(*(t.view(-1).split(size) for t in tensors), strict=True)


def _scratch_like(chunk: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch, as a flat tensor of ``dtype`` as long as ``chunk``."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < chunk.numel() or buf.dtype != dtype:
        buf = _scratch.buf = torch.empty(chunk.numel(), dtype=dtype)
    return buf[: chunk.numel()]


def _exact_alpha(
    grad_dtype: torch.dtype, acc_dtype: torch.dtype, scale: float | None
) -> float | None:
    """``1 / scale`` if ``x * (1 / scale)`` equals ``x / scale`` in ``acc_dtype`` for
    every ``x`` of ``grad_dtype``, else None.

    That holds for a power of two ``scale >= 1`` (its reciprocal is exact, no product
    overflows) whose quotients never fall below ``acc_dtype``'s smallest subnormal:
    then every product is exact, and ``add_``'s fused multiply-add rounds once, like
    the addition after an exact division. For fp32 accumulators: bf16 gradients up to
    ``scale = 2**16``, fp16 ones up to ``2**125``, fp32 ones only ``scale = 1``.
    """
    if scale is None:
        return 1.0
    if not (grad_dtype.is_floating_point and acc_dtype.is_floating_point):
        return None
    if scale < 1 or math.frexp(scale)[0] != 0.5:
        return None
    src, dst = torch.finfo(grad_dtype), torch.finfo(acc_dtype)
    if src.eps < dst.eps or src.tiny * src.eps / scale < dst.tiny * dst.eps:
        return None
    return 1.0 / scale


def _exact_reciprocal(dtype: torch.dtype, scale: float | None) -> float | None:
    """``1 / scale`` if ``x * (1 / scale)`` is ``x / scale`` bit for bit for every ``x``
    of ``dtype``, else None: ``scale`` a power of two that is, like its reciprocal, a
    normal number of ``dtype`` (both results round the same real number). In cache a
    multiply costs half a division."""
    if scale is None or not dtype.is_floating_point or math.frexp(scale)[0] != 0.5:
        return None
    tiny = torch.finfo(dtype).tiny
    if not tiny <= scale <= 1 / tiny:
        return None
    return 1.0 / scale


def _unscale(
    src: torch.Tensor, out: torch.Tensor, scale: float | None, recip: float | None
) -> None:
    """``out = src / scale`` (``out`` may be ``src``), as a multiply where that is exact;
    a copy without a ``scale``."""
    if scale is None:
        out.copy_(src)
    elif recip is None:
        torch.div(src, scale, out=out)
    else:
        torch.mul(src, recip, out=out)


def _unscaled_copy(grad: torch.Tensor, dtype: torch.dtype, scale: float | None) -> torch.Tensor:
    """A new ``grad.to(dtype) / scale`` (never aliasing ``grad``); memory sees one pass."""
    if scale is None:
        return grad.to(dtype, copy=True)
    if not _flat(grad):
        return _reference_grad(grad, dtype, scale)
    out = torch.empty(grad.shape, dtype=dtype)
    recip = _exact_reciprocal(dtype, scale)
    if grad.dtype == dtype:
        _unscale(grad, out, scale, recip)
    else:  # each chunk is unscaled while it is still in cache
        for o, g in _chunks(out, grad):
            o.copy_(g)
            _unscale(o, o, scale, recip)
    return out


def _add_unscaled(acc: torch.Tensor, grad: torch.Tensor, scale: float | None) -> None:
    """``acc += grad.to(acc.dtype) / scale`` in place, bit for bit; memory sees one pass."""
    alpha = _exact_alpha(grad.dtype, acc.dtype, scale)
    same = grad.dtype == acc.dtype
    if same and alpha is not None:
        acc.add_(grad, alpha=alpha)  # one op, no temporary
        return
    # A CPU op converts a lower-precision operand into a full-size copy first, so the
    # conversion (and an unscaling that cannot be add_'s alpha) goes through a
    # cache-resident scratch chunk.
    recip = _exact_reciprocal(acc.dtype, scale)
    for a, g in _chunks(acc, grad):
        s = _scratch_like(g, acc.dtype)
        if same:  # then alpha is None: scale is not None
            _unscale(g, s, scale, recip)
            a.add_(s)
            continue
        s.copy_(g)
        if alpha is None:
            _unscale(s, s, scale, recip)
            a.add_(s)
        else:
            a.add_(s, alpha=alpha)


def _has_grad_hooks(param: torch.Tensor) -> bool:
    """Whether ``param`` has a ``register_hook`` or ``register_post_accumulate_grad_hook``
    hook (torch keeps them in these dicts, ``None`` until the first one)."""
    return bool(getattr(param, "_backward_hooks", None)) or bool(
        getattr(param, "_post_accumulate_grad_hooks", None)
    )

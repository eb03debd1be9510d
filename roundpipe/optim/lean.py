"""AdamW with lean states over torchao's step (docs/design.md#host-memory).

Both classes subclass torchao's own optimizers and keep their arithmetic: the update is
torchao's ``single_param_adam`` (the 8-bit one: the same arithmetic, in a kernel that
runs fast on CPU, see :mod:`roundpipe.optim.quant8`). What they change is how a step
walks the parameters:

- **Flat.** Each parameter, gradient and state is stepped as a 1-D view (a parameter
  without one, a transposed weight or a column slice, as a contiguous copy in its
  logical order, written back in place). The states are created flat (``exp_avg`` of
  a ``(8192, 2048)`` weight has shape ``(16777216,)``); a checkpoint records them as
  state tensors of another shape than their parameter, which a load then does not
  compare with it.
- **Own random numbers.** torchao's bf16 stochastic rounding draws from the process's
  CPU generator inside its compiled step (inductor seeds its kernels from it). The
  emulated devices seed that generator per layer under a lock of theirs
  (docs/design.md#random-numbers), and the optimizer thread steps while they run, so
  each would disturb the other's draws. Here the rounding's 16 random bits per value
  come from a stream keyed by ``(seed, parameter index, step)``: in the C kernel a
  counter-based generator (splitmix64 of the value's index), elsewhere a
  ``torch.Generator`` of the optimizer's own seeded with the key. The same seed gives
  the same result bit for bit, a resumed run continues as the uninterrupted one did
  (the step count is in the checkpoint), and the process's generator is never used.
- **States keep their dtype through a checkpoint.** ``Optimizer.load_state_dict``
  casts every floating state tensor to its parameter's dtype; a load here puts the
  saved moments back as they were (fp32 moments of bf16 masters stay fp32, exactly).
- **A float ``lr`` is taken.** torchao keeps each group's ``lr`` as a tensor (a float
  would recompile the step at each new value) and refuses a float set later; a step
  here turns one back into a tensor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torchao.optim import AdamW8bit as _TorchaoAdamW8bit
from torchao.optim import _AdamW as _TorchaoAdamW
from torchao.optim.adam import single_param_adam
from torchao.optim.subclass_8bit import OptimState8bit

from .quant8 import compiled_adamw8bit_step, kernel_adamw8bit_step, kernel_adamw_step

__all__ = ["AdamW", "AdamW8bit"]

_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """A 63-bit seed mixed from ``values`` (splitmix64's finaliser over each in turn):
    neighbouring steps and parameters get unrelated generator streams."""
    state = 0x9E3779B97F4A7C15
    for value in values:
        state = (state ^ (value & _MASK64)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 31)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 29
    return state >> 1


def round_bf16_stochastic(x: Tensor, bits: Tensor) -> Tensor:
    """``x`` (fp32) rounded to bf16 away from zero with probability (its low 16 bits)
    / 2^16, ``bits`` the random 16-bit integers (int32) it is compared with: torchao's
    ``_fp32_to_bf16_sr`` with the random numbers given instead of drawn."""
    x_bits = x.view(torch.int32)
    toward_zero = x_bits & -65536  # 0xFFFF0000 as int32
    rounded = torch.where(bits < (x_bits & 0xFFFF), toward_zero + 0x10000, toward_zero)
    return rounded.view(torch.float32).bfloat16()


_compiled_adam = torch.compile(single_param_adam, fullgraph=True, dynamic=False)


if TYPE_CHECKING:
    _OptimizerBase = torch.optim.Optimizer
else:
    _OptimizerBase = object


class _LeanSteps(_OptimizerBase):
    """The step shared by :class:`AdamW` and :class:`AdamW8bit` (a mixin over torchao's
    ``_AdamBase``, which provides the groups, ``_new_buffer`` and the options)."""

    if TYPE_CHECKING:  # what torchao's _AdamBase provides beyond the Optimizer
        bf16_stochastic_round: bool

        def __init__(self, *args: Any, **kwargs: Any) -> None: ...

        def _new_buffer(self, p: Tensor, signed: bool) -> Tensor: ...

    def _init_seed(self, seed: int | None) -> None:
        self.seed = torch.initial_seed() if seed is None else int(seed)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = -1
        # A model has a fixed set of (shape, dtype, group option) combinations, each
        # compiled once: torchao lifts the recompile limit the same way.
        with torch._dynamo.utils.disable_cache_limit():
            for group in self.param_groups:
                if not isinstance(group["lr"], Tensor):
                    group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32)
                if group.get("amsgrad"):
                    raise ValueError(f"{type(self).__name__} does not take amsgrad=True")
                for param in group["params"]:
                    index += 1
                    if param.grad is None:
                        continue
                    if param.grad.is_sparse:
                        raise RuntimeError("AdamW does not take sparse gradients")
                    self._step_one(index, param, group)
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        saved = {
            (index, key): value
            for index, values in state_dict["state"].items()
            for key, value in values.items()
            if key != "step" and type(value) is Tensor
        }
        super().load_state_dict(state_dict)
        params = [p for group in self.param_groups for p in group["params"]]
        for (index, key), value in saved.items():
            self.state[params[index]][key] = value.clone()

    def _step_one(self, index: int, param: Tensor, group: dict) -> None:
        assert param.grad is not None
        target = param.detach()
        # A parameter without a flat view (a transposed weight, a column slice) is
        # stepped as a contiguous copy, its values in the logical order that torchao's
        # blocks and the rounding's random numbers follow, and written back in place.
        flat = target.contiguous().view(-1)  # the parameter itself where contiguous
        self._step_flat(index, flat, param.grad, self.state[param], group)
        if not target.is_contiguous():
            target.copy_(flat.view(target.shape))

    def _step_flat(self, index: int, flat: Tensor, grad: Tensor, state: dict, group: dict):
        """One step of ``flat`` (a contiguous 1-D parameter) and its ``state``."""
        if len(state) == 0:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = self._new_buffer(flat, True)
            state["exp_avg_sq"] = self._new_buffer(flat, False)
        state["step"] += 1
        shape = state["exp_avg"].shape
        target = flat.view(shape)
        grad = grad.contiguous().view(shape)
        rounds = self.bf16_stochastic_round and flat.dtype is torch.bfloat16
        key = _mix(self.seed, index, int(state["step"].item())) if rounds else None
        args: tuple[Tensor | float, ...] = (state["step"], state["exp_avg"], state["exp_avg_sq"])
        args += (group["lr"], *group["betas"], group["weight_decay"], group["eps"])
        if self._kernel_step(target, grad, *args, key):
            return
        # No kernel for these tensors: torchao's compiled step, on an fp32 copy where
        # the result is rounded here, from a generator of the optimizer's own.
        work = target.float() if rounds else target
        self._compiled_step(work, grad, *args)
        if key is not None:  # rounds
            generator = torch.Generator().manual_seed(key)
            bits = torch.randint(0, 1 << 16, shape, dtype=torch.int32, generator=generator)
            target.copy_(round_bf16_stochastic(work, bits))  # integer ops: exact eagerly

    def _kernel_step(self, *args) -> bool:
        return kernel_adamw_step(*args)

    def _compiled_step(self, param, grad, step, exp_avg, exp_avg_sq, lr, beta1, beta2, wd, eps):
        _compiled_adam(
            param, grad, step, exp_avg, exp_avg_sq, None, lr, beta1, beta2, wd, eps, True, False
        )


class AdamW(_LeanSteps, _TorchaoAdamW):
    """torchao's AdamW step with both moments kept as plain tensors of ``state_dtype``
    (fp32 or bf16), whatever the parameters' dtype; ``bf16_stochastic_round`` rounds
    bf16 parameters stochastically from the optimizer's own ``seed``."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        state_dtype: torch.dtype = torch.float32,
        bf16_stochastic_round: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            params, lr, betas, eps, weight_decay, bf16_stochastic_round=bf16_stochastic_round
        )
        self.state_dtype = state_dtype
        self._init_seed(seed)

    def _new_buffer(self, p: Tensor, signed: bool) -> Tensor:
        return torch.zeros(p.shape, dtype=self.state_dtype, device=p.device)


class AdamW8bit(_LeanSteps, _TorchaoAdamW8bit):
    """torchao's ``AdamW8bit`` (its state format, arithmetic and results) with a step
    that runs fast on CPU tensors; ``bf16_stochastic_round`` rounds bf16 parameters
    stochastically from the optimizer's own ``seed``."""

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        *,
        block_size: int = 256,
        bf16_stochastic_round: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            block_size=block_size,
            bf16_stochastic_round=bf16_stochastic_round,
        )
        self._init_seed(seed)

    def _kernel_step(self, param, grad, step, exp_avg, *args) -> bool:
        if isinstance(exp_avg, OptimState8bit):
            return kernel_adamw8bit_step(param, grad, step, exp_avg, *args)
        return kernel_adamw_step(param, grad, step, exp_avg, *args)  # below the threshold

    def _compiled_step(self, param, grad, step, exp_avg, *args):
        if isinstance(exp_avg, OptimState8bit):
            compiled_adamw8bit_step(param, grad, step, exp_avg, *args)
        else:
            super()._compiled_step(param, grad, step, exp_avg, *args)

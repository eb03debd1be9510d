"""Catch an optimizer built over the wrapped model's parameters instead of the masters.

``torch.optim.SGD(pipe.parameters())`` would step tensors that never receive a
gradient (gradients accumulate on the master copies) and silently train nothing.
A global optimizer step pre-hook, registered when the first model is built,
raises on the first step of any optimizer holding a parameter of an open model.
"""

from __future__ import annotations

import weakref

from torch.optim.optimizer import register_optimizer_step_pre_hook

_watched: weakref.WeakSet = weakref.WeakSet()
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_hooked: list[bool] = []


def watch(store) -> None:
    """Refuse optimizer steps over ``store``'s user parameters until :func:`unwatch`."""
    if not _hooked:
        register_optimizer_step_pre_hook(_check)
        _hooked.append(True)
    _watched.add(store)
    _checked.clear()


def unwatch(store) -> None:
    _watched.discard(store)


def _check(optimizer, args, kwargs) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if _checked.get(optimizer) == len(params):
        return
    for store in list(_watched):
        if any(id(p) in store.user_param_ids for p in params):
            raise RuntimeError(
                "this optimizer holds the wrapped model's own parameters, which never "
                "receive gradients under RoundPipe; build it over pipe.optim_parameters() "
                "(the master copies), or use pipe.parameters() inside `with pipe.OptimizerCtx():`"
            )
    _checked[optimizer] = len(params)

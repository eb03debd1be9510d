"""``model(...)`` on a RoundPipe model: a pipelined forward whose output can be
back-propagated later (the ``nn.Module`` call path of :class:`~roundpipe.RoundPipe`)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..core.config import RoundPipeRunConfig
from ..core.keys import Activation, InputGrad
from ..core.schedule import lower_unfused
from ..devices.base import Slot
from ..runtime.call import Call
from ..runtime.deferred import attach_backward, check_backward_allowed
from ..runtime.microbatch import merge_outputs
from ..runtime.sync import Handoff


class ModuleCall:
    """``forward`` of :class:`~roundpipe.RoundPipe` (a mixin: it uses the model's session,
    pool and call helpers). Inference under ``torch.no_grad()``; with autograd enabled,
    a later ``.backward()`` runs the backward stages."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the model on the pool, pipelined.

        Under ``torch.no_grad()`` (or with no trainable parameter) this is inference.
        With autograd enabled the output can be back-propagated later: ``.backward()``
        on (a function of) it runs the backward stages, recomputing from saved stage
        inputs, and accumulates the parameter gradients like ``forward_backward``.
        Prefer ``forward_backward``: it fuses the last stage and overlaps calls.
        """
        return self._forward(args, kwargs, self.run_config)

    def _forward(self, args: tuple, kwargs: dict, config: RoundPipeRunConfig) -> Any:
        training = torch.is_grad_enabled() and any(p.requires_grad for p in self.model.parameters())
        if training and config.merge_output is not None:
            raise NotImplementedError(
                "model(...) with autograd enabled needs the default output merging; "
                "use forward_backward(...) with a custom merge_output"
            )
        with self._session.enter("forward") as session:
            self._begin(session)
            num = config.microbatches_for(len(self.pool))
            inputs, _, owned = self._own_inputs(config, args, kwargs, None, num)
            schedule = lower_unfused(
                self._plan_for(config), len(self.pool), self._cursor, with_backward=training
            )
            # A training call's inputs are re-read by its later backward: not recycled.
            call = self._start_call(
                session, schedule, inputs, None, config, None, False, [] if training else owned
            )
            try:
                outputs = [call.read(Activation(self.num_layers, m))[0][0] for m in range(num)]
            except Exception as exc:
                session.fail(call.latch.wait() or exc)
            session.returned(call)
        merged = (config.merge_output or merge_outputs)(outputs)
        if not training:
            return merged
        return attach_backward(merged, outputs, functools.partial(self._backward_call, call))

    def _backward_call(self, call: Call, grads_per_microbatch: list[list]) -> None:
        """Post the output gradients, run the call's backward jobs and wait for them."""
        with self._session.enter("backward") as session:
            check_backward_allowed(call, session, self._layers)
            self._begin(session)
            loss_scale = self._loss_scale()  # the user scaled the loss just before
            for m, grads in enumerate(grads_per_microbatch):
                call.mailbox.post(InputGrad(self.num_layers, m), Handoff(Slot(grads), None))
            session.issue_backward(call, loss_scale)
            error = call.latch.wait()
            if error is not None:
                session.fail(error)
            session.returned(call)

"""The failure rules, each decided here and nowhere else (docs/design.md#failure-rules).

Whether a call counts as failed, which gradients its failure discards, and what the
reported error says about the model and its gradients: the session and the optimizer
thread ask here and apply the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..errors import RoundPipeError
from .call import Call
from .ledger import CallState
from .params import ParameterStore


class CallInterrupted(RoundPipeError):
    """Cancels the jobs of a call whose issuing was interrupted."""


def failed(call: Call, state: CallState) -> bool:
    """Whether ``call`` counts as failed: a job failed, or the caller never got its result."""
    return call.failed or not state.returned


def discard_gradients(
    store: ParameterStore,
    failed_calls: Iterable[Call],
    state_of: Callable[[Call], CallState],
    reduced: bool = False,
) -> tuple[Call, ...]:
    """Apply the gradient rule after ``failed_calls`` failed; returns the calls whose
    accumulated gradients were discarded (discarding happened if any, or ``reduced``:
    on several nodes, once the gradients went to the reduction)."""
    accumulated = tuple(call for call in failed_calls if state_of(call).accumulated)
    if accumulated or reduced:
        store.discard_grads()
    return accumulated


def note_usable_again(
    error: BaseException, discarded: bool, kept_for_retry: bool, stepped: int = 0
) -> None:
    """Say on ``error`` that the model is usable again, what became of the gradients,
    and how many masters had stepped in a failed call's backward (once per error)."""
    if getattr(error, "roundpipe_noted", False) or not hasattr(error, "add_note"):
        return
    if discarded:
        text = "the gradients accumulated since the last step were discarded"
    elif kept_for_retry:
        text = "the gradients were kept; step() again to retry"
    else:
        text = "the gradients accumulated since the last step were kept"
    if stepped:
        text += (
            f"; {stepped} parameters had stepped in the backward before it failed, as "
            "post-accumulate-grad hooks do in PyTorch"
        )
    error.add_note(f"roundpipe: the model is usable again ({text})")
    error.roundpipe_noted = True  # type: ignore[attr-defined]

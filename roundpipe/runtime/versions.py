"""Weight versions: which weights each call uploads, and how steps publish new ones.

This module owns the rule of which version a call reads: :class:`WeightVersions` holds
the two upload buffers of every trainable parameter, and :class:`VersionState` records
which buffer holds which version as immutable data, which the session replaces with one
assignment, so an interrupt never leaves it half-changed (docs/design.md#weight-versions).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .params import ParamEntry, ParameterStore
from .sync import VersionGate

HOME, SPARE = 0, 1


@dataclass(frozen=True)
class VersionState:
    """Which version the next call reads, the newest queued one, and where each lives."""

    read: int = 0
    newest: int = 0
    homes: tuple[tuple[int, int], ...] = ((0, HOME),)
    """``(version, buffer)`` for the (at most two) live versions."""

    def home_of(self, version: int) -> int:
        return dict(self.homes)[version]

    def after_step(self, is_async: bool) -> VersionState:
        """A step was queued: it publishes ``newest + 1``.

        An asynchronous step writes the other buffer: the calls queued after it read
        ``newest`` meanwhile. A synchronous one rewrites ``newest``'s own buffer, which
        nobody reads while it runs (the calls before it are done first, the calls after
        it wait for it, and an older version's buffer is the other one), so steps that
        are all synchronous never need a spare buffer.
        """
        version = self.newest + 1
        if not is_async:
            return VersionState(
                read=version, newest=version, homes=((version, self.home_of(self.newest)),)
            )
        target = SPARE if self.home_of(self.newest) == HOME else HOME
        homes = ((self.newest, self.home_of(self.newest)), (version, target))
        return VersionState(read=self.newest, newest=version, homes=homes)

    def settled_home(self) -> VersionState:
        """Nothing in flight and the user's tensors hold the newest version."""
        return VersionState(read=self.newest, newest=self.newest, homes=((self.newest, HOME),))


class WeightVersions:
    """The upload buffers of every trainable parameter and the 'version published' gate."""

    def __init__(
        self,
        store: ParameterStore,
        pin: Callable[[torch.Tensor], torch.Tensor],
        unpin: Callable[[int], None],
        gather: Callable[[Callable[[int], torch.Tensor]], None] | None = None,
    ) -> None:
        self.store = store
        self._pin = pin
        self._unpin = unpin
        self._spares: dict[int, torch.Tensor] = {}
        self.published = VersionGate(0)
        self.gather = gather
        """On several nodes: fills the weights other nodes own into the buffer being
        published, given ``uid -> that buffer's tensor`` (a collective)."""

    # -- reading ----------------------------------------------------------------------

    def source(self, uid: int, buffer: int) -> torch.Tensor:
        """What a call reading ``buffer`` uploads for parameter ``uid``."""
        entry = self.store.entries[uid]
        if not entry.trainable or buffer == HOME:
            return entry.param.data
        return self._spare(uid)

    def _spare(self, uid: int) -> torch.Tensor:
        spare = self._spares.get(uid)
        if spare is None:
            spare = self._pin(torch.empty_like(self.store.entries[uid].param.data))
            self._spares[uid] = spare
        return spare

    # -- the optimizer thread ----------------------------------------------------------

    def prepare(self, buffer: int) -> None:
        """Before a step that publishes into ``buffer``: a master that is the model's own
        tensor (:attr:`ParamEntry.aliased`) moves there, so that the step writes the
        version it makes in place while calls keep reading the other buffer.

        The move copies the master's values (the previous version) into ``buffer`` and
        points the master at it; the optimizer's state is keyed by the master object, which
        stays the same. A parameter the user wrote in place in ``buffer`` keeps the write:
        that step's master is a private copy, and the write is adopted before the next call
        (as :meth:`publish` leaves such a parameter for masters of their own).
        """
        with torch.no_grad():
            for uid, entry in self.store.entries.items():
                if not entry.aliased or entry.master is None:
                    continue
                target = self.source(uid, buffer)
                if buffer == HOME and entry.externally_modified():
                    target = torch.empty_like(target)
                if not _same_storage(entry.master, target):
                    target.copy_(entry.master)
                    entry.master.data = target

    def publish(self, version: int, buffer: int) -> None:
        """Write the masters into ``buffer`` as ``version`` and let readers of it go.

        A parameter the user wrote in place meanwhile is left as written (it is
        adopted before the next call); everything else is overwritten. A master that is
        the buffer's own tensor (moved there by :meth:`prepare`) is written already.
        """
        with torch.no_grad():
            for uid, entry in self.store.entries.items():
                if entry.master is None:
                    continue
                if buffer == HOME and entry.externally_modified():
                    continue
                target = self.source(uid, buffer)
                if not _same_storage(entry.master, target):
                    target.copy_(entry.master)
        if self.gather is not None:
            self.gather(lambda uid: self.source(uid, buffer))
        self.published.advance_to(version)

    # -- with nothing in flight ----------------------------------------------------------

    def make_current(self, state: VersionState) -> tuple[VersionState, bool]:
        """The user's tensors show the newest version (and ``.grad``), except those the
        user wrote into, whose values the masters take over; the next call reads them.

        Returns that state, and whether any user tensor or master was rewritten.
        """
        moved = state.home_of(state.newest) == SPARE
        rewritten = moved
        with torch.no_grad():
            for uid, entry in self.store.entries.items():
                if entry.externally_modified():
                    _adopt(entry, self._pin, self._unpin)
                    rewritten = True
                elif moved and entry.trainable:
                    entry.param.data.copy_(self._spare(uid))
                if entry.master is not None:
                    if entry.aliased:
                        entry.master.data = entry.param.data
                    entry.show_grad()
                entry.mark_seen()
        settled = state.settled_home()
        self.published.advance_to(settled.newest)
        return settled, rewritten

    def republish(self, state: VersionState) -> None:
        """After a failed publish: rewrite the newest version from the masters."""
        self.published.reset()
        self.publish(state.newest, state.home_of(state.newest))


def _adopt(
    entry: ParamEntry, pin: Callable[[torch.Tensor], torch.Tensor], unpin: Callable[[int], None]
) -> None:
    """The user wrote into (or replaced) ``entry``'s tensor: page-lock what it holds now,
    give back the hold on what it held (a replaced storage is not kept locked and
    alive), and the master takes the values."""
    unpin(entry.pin(pin))
    if entry.master is not None and not entry.aliased:  # an aliased one: make_current
        entry.master.copy_(entry.param.data)
    entry.mark_seen()


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape

"""``UsageError``: what the user got wrong, below every module that finds it (the options,
the config file, the inputs), so each can raise it; :mod:`.options` is where the rest
of the command imports it from."""

from __future__ import annotations


class UsageError(ValueError):
    """Bad or contradictory options, or inputs that cannot work: exit code 2."""

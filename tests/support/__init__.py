"""Helpers for the test suite, not tests themselves.

``tests/`` is on ``sys.path`` under pytest (it has a ``conftest.py`` and no
``__init__.py``), so test modules import these as ``support.oracle`` and so on; the
child processes in ``support/children`` put ``tests/`` on their own path.

* ``oracle``: plain-PyTorch reference training, the oracle the runtime tests compare with.
* ``faults``: fault injection for the failure tests (a switchable faulty layer, failing
  losses, transfers and step functions).
* ``multinode`` / ``multinode_scenarios``: several local gloo processes, one per node.
* ``lifecycle``: the small model the close/exit and concurrency tests drive, and the
  threads roundpipe started.
* ``pipes``: ``pipe_on``, a model on emulated devices under a run config.
* ``emulator``: emulated pools and gates driven below the runtime (the ``harness``
  fixture).
* ``train_fixtures`` / ``train_ranks``: tiny inputs for ``roundpipe train`` and its
  launch as several ranks.
* ``train_cli``: ``roundpipe train`` as a real process, what a run wrote, and the
  shared runs (the ``train_files`` / ``train_runs`` fixtures).
* ``bpe_tokenizer``: a tiny byte-level BPE tokenizer with ChatML tokens (the
  ``tokenizer`` fixture).
* ``children``: scripts run as subprocesses (exit, Ctrl-C, checkpoint and loading
  tests), with ``children/harness.py`` shared by them and the tests that start them.
"""

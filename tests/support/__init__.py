"""Helpers for the test suite, not tests themselves.

``tests/`` is on ``sys.path`` under pytest (it has a ``conftest.py`` and no
``__init__.py``), so test modules import these as ``support.oracle`` and so on; the
child processes in ``support/children`` put ``tests/`` on their own path.

* ``oracle``: plain-PyTorch reference training, the oracle the runtime tests compare with.
* ``faults``: fault injection for the failure tests (a switchable faulty layer, failing
  losses, transfers and step functions).
* ``multinode`` / ``multinode_scenarios``: several local gloo processes, one per node.
* ``train_fixtures`` / ``train_ranks``: tiny inputs for ``roundpipe train`` and its
  launch as several ranks.
* ``children``: scripts run as subprocesses (exit, Ctrl-C, checkpoint and loading
  tests), with ``children/harness.py`` shared by them and the tests that start them.
"""

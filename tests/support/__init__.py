"""Helpers for the test suite, not tests themselves.

The test files live in folders that mirror the package (``tests/core/``,
``tests/runtime/``, ``tests/hf/``, ``tests/train/``, ...; ``tests/cli/`` for the command
surface, ``tests/project/`` for the docs and scripts), each file's name unique across
them. ``tests/`` is on ``sys.path`` under pytest (it has the ``conftest.py`` and no
``__init__.py``), so test modules import these as ``support.oracle`` and so on (never
one another: what two test files share lives here); the child processes in
``support/children`` put ``tests/`` on their own path.

* ``oracle``: plain-PyTorch reference training, the oracle the runtime tests compare with.
* ``faults``: fault injection for the failure tests (a switchable faulty layer, failing
  losses, transfers and step functions).
* ``multinode`` / ``multinode_scenarios``: several local gloo processes, one per node.
* ``lifecycle``: the small model the close/exit and concurrency tests drive, and the
  threads roundpipe started.
* ``pipes``: ``pipe_on``, a model on emulated devices under a run config.
* ``emulator``: emulated pools and gates driven below the runtime (the ``harness``
  fixture).
* ``train_fixtures`` / ``train_ranks``: tiny inputs for ``roundpipe train`` (the tiny
  Qwen3's config: ``tiny_qwen3_config``) and its launch as several ranks.
* ``train_cli``: ``roundpipe train`` as a real process, what a run wrote, and the
  shared runs (the ``train_files`` / ``train_runs`` fixtures).
* ``bpe_tokenizer``: a tiny byte-level BPE tokenizer with ChatML tokens (the
  ``tokenizer`` fixture).
* ``children``: scripts run as subprocesses (exit, Ctrl-C, checkpoint and loading
  tests), with ``children/harness.py`` shared by them and the tests that start them.
* ``programs``: hypothesis strategies for plans, random cases lowered to op programs,
  and the golden cases.
* ``device_memory``: a device's memory once the runtime let go; a model that runs out
  of a small emulated capacity.
* ``dropout_models``: dropout that records its masks, and replays them in a reference.
* ``hf_families``: the tiny ``from_hf`` model of each family our own adapter covers,
  and the checks against the model itself.
* ``long_context_models``: the long-context tests' decoders and long batches.
* ``nf4_cases``: the weights the NF4 format is checked on, and bitsandbytes' answer.
"""

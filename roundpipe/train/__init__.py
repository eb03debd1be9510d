"""``roundpipe train``: fine-tune a Hugging Face causal LM on a JSONL file.

How it works: docs/design.md#the-train-command; how to use it: the README.

- ``command``: the subcommand's parser, run and exit codes.
- ``options``: the option table (command line, ``--config`` YAML, ``run.yaml``).
- ``preflight``: everything checked and read before training.
- ``data``, ``chat``, ``batches``: the JSONL file as labelled examples, then batches.
- ``loop``: the run (train, evaluate, checkpoint, Ctrl-C); ``optim``: AdamW, LR schedule.
- ``checkpoints``: ``checkpoints/step-N``, resume and pruning.
- ``ranks``: under ``torchrun``, one process per node.
- ``report``, ``progress``: ``metrics.jsonl`` and ``loss.png``; the progress bar.
- ``demo``: the assets of ``--demo``.
"""

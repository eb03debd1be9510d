"""``roundpipe train``: fine-tune a Hugging Face causal LM on a JSONL file.

How it works: docs/design.md#the-train-command; how to use it: the README.

- ``command``: the subcommand's parser, run and exit codes.
- ``options``: the option table (command line, ``--config`` YAML, ``run.yaml``).
- ``preflight``, ``model_checks``: everything checked and read before training.
- ``lock``: the lock a run holds on ``--output``.
- ``data``, ``chat``, ``batches``: the JSONL file as labelled examples, then batches.
- ``loop``: the run (train, evaluate, checkpoint); ``optim``: AdamW, LR schedule.
- ``stopping``: Ctrl-C, SIGTERM, SIGHUP; ``disk``: a full disk as one line.
- ``checkpoints``: ``checkpoints/step-N``, resume and pruning; ``result``: the adapter
  or the model, and whether it is complete.
- ``ranks``: under ``torchrun``, one process per node.
- ``report``, ``progress``: ``metrics.jsonl`` and ``loss.png``; the progress bar.
- ``demo``: the assets of ``--demo``; ``quiet``: transformers without its noise.
"""

"""``roundpipe train``: fine-tune a Hugging Face causal LM on a JSONL file.

How it works: docs/design.md#the-train-command; how to use it: docs/cli.md.

- ``command``: the subcommand's parser, run and exit codes.
- ``options``: the option table (command line, ``--config`` YAML, ``run.yaml``).
- ``preflight``, ``model_checks``, ``memory_check``: everything checked and read before
  training, the host memory the run needs included.
- ``lock``: the lock a run holds on ``--output``.
- ``data``, ``chat``, ``batches``: the JSONL file as labelled examples, then batches;
  ``images``: the images of vision chat records.
- ``loop``: the run (train, evaluate, checkpoint); ``optim``: AdamW, LR schedule.
- ``stopping``: Ctrl-C, SIGTERM, SIGHUP; ``disk``: a full disk as one line.
- ``checkpoints``: ``checkpoints/step-N``, resume and pruning; ``result``: the adapter
  or the model, and whether it is complete.
- ``ranks``: under ``torchrun``, one process per node.
- ``report``, ``progress``, ``data_summary``: ``metrics.jsonl`` and ``loss.png``; the
  progress bar; what the start says about the data.
- ``export``, ``chat_command``, ``chat_templates``, ``environment``: ``roundpipe export``,
  ``roundpipe chat``, ``--chat-template``, ``roundpipe env`` and ``--version``.
- ``demo``: the assets of ``--demo``; ``quiet``: transformers without its noise.
"""

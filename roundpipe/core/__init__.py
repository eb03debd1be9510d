"""Call data: plans, schedules, op programs, handoff keys, run configs, timelines.

Pure values, no threads and no devices; every other layer builds on them
(docs/design.md#layers).

- ``plan``: ``Plan``, the layers cut into forward and backward stages.
- ``schedule``: ``lower``, a plan as the ordered round-robin jobs of one call.
- ``program``: ``job_program``, one job as the device ops it runs, stream by stream.
- ``keys``: what jobs hand each other (``Activation``, ``InputGrad``, ``RngState``, ...).
- ``config``: ``RoundPipeRunConfig``, the run-time options of a model.
- ``timeline``: ``Timeline``, what ran where and when; Chrome trace and Gantt export.
"""

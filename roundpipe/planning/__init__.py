"""Choosing plans: the partitioner, the automatic planner, the simulator.

Pure logic over cost models, no devices (docs/design.md#partitioner).

- ``partition``: ``auto_plan``, the plan the simulator predicts to be fastest.
- ``search``: the candidates and the bound-ordered search behind ``auto_plan``.
- ``rules``: packing, the paper's rule, equal-size plans, the memory fit.
- ``planner``: ``AutoPlanner``, the plan kept in step with measured costs (re-plans on a thread).
- ``sim``: the discrete-event simulator of RoundPipe and the weight-bound baselines.
"""

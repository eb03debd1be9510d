"""Model-level predictions: will a model fit on a box, how fast, against what.

Pure logic on top of the planner and the simulator, no devices
(docs/design.md#predictions).

- ``models``: ``predict``, tokens/s and memory of a model on N GPUs of a preset.
- ``nodes``: ``predict_nodes``, the same across K nodes joined by a network.
- ``unit_costs``: seconds and bytes of each pipeline unit, calibrated.
- ``model_specs``: ``ModelSpec``, the shapes and parameter counts of a decoder.
- ``gpus``: GPU, precision and PCIe presets.
- ``simulate_command``: the ``roundpipe simulate`` subcommand.
"""

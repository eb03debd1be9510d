"""Model-level predictions: will a model fit on a box, how fast, against what.

Pure logic on top of the planner and the simulator, no devices
(docs/design.md#predictions).

- ``models``: ``predict``, tokens/s and memory of a model on N GPUs of a preset.
- ``nodes``: ``predict_nodes``, the same across K nodes joined by a network.
- ``breakdown``: host RAM and per-GPU memory term by term, and the fit verdicts.
- ``nearest``: ``nearest_fit``, the nearest configuration that fits when one does not.
- ``host_settings``: ``LeanSettings``, the host dtypes of the optimizer's state, the
  masters and a LoRA base, and their bytes per parameter.
- ``lean_fit``: ``lean_fit``, the lean setting that fits the host RAM when the run's
  own does not.
- ``nf4_uploads``: ``upload_savings``, what an NF4 base saves on the PCIe links.
- ``unit_costs``: seconds and bytes of each pipeline unit, calibrated; ``layer_terms``,
  a layer's per-token bytes by kind.
- ``model_specs``: the named presets and ``ModelSpec`` (``model_shape``: the shapes and
  parameter counts of a decoder; ``config_reader``: read from a Hugging Face config;
  ``layer_kinds``: each layer's token mixer and feed-forward block).
- ``mixers``, ``recurrent_mixers``: token mixers priced per token (attention, MLA;
  Gated DeltaNet, Mamba2), ``op_bytes`` the bytes their ops move.
- ``gpus``: GPU, precision and PCIe presets.
- ``host_memory``: this machine's host RAM, installed and what a process may still
  allocate (``MemAvailable``, cgroup limits, ``RLIMIT_AS``).
- ``simulate_command``: the ``roundpipe simulate`` subcommand; ``model_mode``, its
  model-level mode.
"""

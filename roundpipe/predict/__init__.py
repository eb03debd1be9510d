"""Model-level predictions: model shapes, GPU presets, unit costs, several nodes."""

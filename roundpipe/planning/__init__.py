"""Choosing plans: partition search, the adaptive planner, the simulator.

Pure logic over cost models: no threads, no devices.
"""

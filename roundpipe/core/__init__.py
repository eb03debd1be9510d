"""Call data: plans, schedules, op programs, handoff keys, run configs, timelines.

Pure values, no threads and no devices; every other layer builds on them.
"""

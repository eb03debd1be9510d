"""The runtime that executes a lowered schedule on a device pool.

``worker`` issues stage jobs to a device's streams, ``transfer`` moves pytrees between
host and device, ``sync`` orders host-side hand-offs, ``params`` is the host home of
weights, master copies and gradients, ``optimizer`` runs steps on a host thread, and
``profiler`` / ``planner`` keep the automatic plan in step with measured layer times.
"""

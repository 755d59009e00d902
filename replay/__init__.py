"""Replay: the reference CED model, the runners that host a model, and the replay coordinator.

Importing this package is cheap; the model (and torch) load only when `replay.reference.model` is imported.
"""
